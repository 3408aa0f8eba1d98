"""A service joins the catalog once it serves, and leaves it when it drains.

Called by every service's entry point when the spec's `discovery.backend` is `consul`;
with the file catalog there is nothing to do (the spec is the catalog), and py-consul is
never imported: the Consul backend is loaded only by a service whose spec names it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from servemesh.catalog.file import ip_of
from servemesh.spec import ResolvedSpec

log = logging.getLogger(__name__)

Leave = Callable[[], Awaitable[None]]


async def join_catalog(spec: ResolvedSpec, instance: str) -> Leave | None:
    """Register `instance` in the spec's catalog; returns the call that deregisters it
    (None: the file catalog, nothing registered). Raises when Consul refuses or is
    unreachable: an instance Envoy could never find should not look alive."""
    if spec.discovery.backend != "consul":
        return None
    # The backend the spec chose, and py-consul with it: not a cost of every service.
    from servemesh.catalog.consul_catalog import ConsulCatalog

    host = spec.host_of(instance)
    address = ip_of(host)
    if address is None:
        raise OSError(f"{instance}: its host {host!r} does not resolve; cannot register")
    catalog = ConsulCatalog(spec)
    await asyncio.to_thread(catalog.register, instance, address)
    log.info(
        "registered in consul", extra={"address": address, "consul": spec.discovery.consul_address}
    )

    async def leave() -> None:
        await asyncio.to_thread(catalog.deregister, instance)
        log.info("deregistered from consul")

    return leave
