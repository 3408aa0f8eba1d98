"""Noticing a rotation from inside a service, for the channels it dials.

A server picks up its new certificate by itself at the next handshake; a client's
credentials are fixed when its channel is made. A service that keeps a channel open for its
whole life (the gateway's to its mesh listener) follows its identity's `current` link and
dials again when it moves, so new connections present the new certificate before the old
one expires.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from servemesh.identity.store import MeshIdentity

log = logging.getLogger(__name__)

# How often a service looks at its certificate link; rotation leaves the old certificate
# valid for days, so this only bounds how soon new connections show the new one.
POLL_S = 2.0


def _generation(identity: MeshIdentity, name: str) -> str | None:
    try:
        return os.readlink(identity.current(name))
    except OSError:
        return None


async def follow_certificate(
    identity: MeshIdentity,
    name: str,
    on_change: Callable[[], Awaitable[None]],
    poll_s: float = POLL_S,
) -> None:
    """Call `on_change()` each time `name`'s certificate is replaced; runs until cancelled."""
    seen = _generation(identity, name)
    while True:
        await asyncio.sleep(poll_s)
        now = _generation(identity, name)
        if now is None or now == seen:
            continue
        seen = now
        log.info("certificate replaced: dialling again", extra={"generation": now})
        try:
            await on_change()
        except Exception:  # the old channel still works; try again at the next change
            log.exception("could not dial with the new certificate")
