"""Against a real Consul agent: a service registers with its mutual-TLS check, the control
plane turns the catalog into endpoint files, deregistration removes it.

Runs where an agent answers (CONSUL_HTTP_ADDR, else 127.0.0.1:8500); skipped otherwise,
saying so. The agent must trust the mesh CA for its checks to pass, which a bare agent does
not, so these tests check registration, the catalog's shape and removal, not passing."""

from __future__ import annotations

import asyncio
import os
import urllib.error
import urllib.request
from collections.abc import Awaitable
from pathlib import Path

import pytest

from servemesh.catalog.consul_catalog import ConsulCatalog, service_id
from servemesh.catalog.registration import join_catalog
from servemesh.spec import MeshSpec, ResolvedSpec, resolve

ADDRESS = os.environ.get("CONSUL_HTTP_ADDR", "127.0.0.1:8500").removeprefix("http://")


async def _awaited(step: Awaitable[None]) -> None:
    await step


def _agent_answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/v1/status/leader", timeout=1) as reply:
            return bool(reply.read().strip(b'"\n'))
    except (urllib.error.URLError, OSError):
        return False


pytestmark = pytest.mark.skipif(
    not _agent_answers(ADDRESS),
    reason=f"no Consul agent reachable at {ADDRESS}; the file catalog is what runs here",
)


def _spec(tmp_path: Path) -> ResolvedSpec:
    declared = {"name": "contract", "ports": {"edge": 0, "mesh": 0, "services_base": 0},
                "state_dir": str(tmp_path),
                "discovery": {"backend": "consul", "consul_address": ADDRESS}}  # fmt: skip
    return resolve(MeshSpec.model_validate(declared))


def test_an_instance_registers_is_listed_with_its_zone_and_leaves(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    leave = asyncio.run(join_catalog(spec, "model-fraud-zone-b-0"))
    assert leave is not None
    catalog = ConsulCatalog(spec)
    try:
        index, entries = catalog.watch("model", 0, 1)
        [entry] = [e for e in entries if e.instance == "model-fraud-zone-b-0"]
        assert (entry.zone, entry.address, entry.port) == (
            "zone-b", "127.0.0.1", spec.port_of("model-fraud-zone-b-0"),
        )  # fmt: skip
        # Nothing serves the port: its check is not passing, so it is no endpoint.
        assert not entry.passing
        checks = catalog.client.agent.checks()
        [check] = [
            c for c in checks.values() if c["ServiceID"] == service_id(spec, "model-fraud-zone-b-0")
        ]
        assert check["Type"] == "grpc"
    finally:
        asyncio.run(_awaited(leave()))
    # A blocking query wakes for the removal.
    _, after = catalog.watch("model", index, 10)
    assert not [e for e in after if e.instance == "model-fraud-zone-b-0"]
