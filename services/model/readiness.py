"""A model replica's health follows the versions the mesh routes traffic to.

The replica reports NOT_SERVING (overall and for the OIP service) while any routed
version, one with weight > 0 in `models.<m>.traffic` or a shadow target, is not loaded
on it. A version counts as loaded only after loading ran it through its batcher (the
warm-up in `loader.load_model`), so a load that completes is also a passed probe
inference. Draining (SIGTERM) turns the replica NOT_SERVING for good.

Each version also has a health status of its own, under `wire.version_health_name`:
SERVING exactly while that version is loaded (and warmed up) and the replica is not
draining. Envoy's cluster of a version health-checks that name, so it routes a version
only to the replicas that hold it. The routed set follows the live spec (`set_routed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from grpc_health.v1 import health_pb2

from servemesh.services.model.repository import Key, ModelRepository, natural_key
from servemesh.services.runtime import ServiceServer
from servemesh.spec import MeshSpec
from servemesh.wire import version_health_name

log = logging.getLogger(__name__)


def routed_versions(spec: MeshSpec) -> set[Key]:
    """Every (model, version) the spec sends traffic to: weight > 0, or a shadow target."""
    routed: set[Key] = set()
    for name, model in spec.models.items():
        routed.update((name, version) for version, weight in model.traffic.items() if weight > 0)
        if model.shadow is not None:
            routed.add((name, model.shadow.version))
    return routed


def _label(key: Key) -> str:
    return f"{key[0]}:{key[1]}"


class ModelServer(ServiceServer):
    """A ServiceServer that is SERVING only while every routed version is loaded.

    Readiness is recomputed when the server starts and after every load and unload of
    `repository`; once draining has begun nothing turns it SERVING again.
    """

    def __init__(
        self, name: str, *, repository: ModelRepository, routed: Iterable[Key], **options: Any
    ) -> None:
        super().__init__(name, **options)
        self.repository = repository
        self.routed: frozenset[Key] = frozenset(routed)
        self._health_lock = asyncio.Lock()
        self._started = False
        self._draining = False
        self._ready: bool | None = None
        # Per-version health as last reported: name -> serving.
        self._versions: dict[str, bool] = {}
        repository.on_change(self.refresh_readiness)

    @property
    def draining(self) -> bool:
        return self._draining

    def is_ready(self) -> bool:
        """What the health service says now: started, every routed version loaded, and
        not draining (OIP ServerReady answers the same)."""
        return self._ready is True and not self._draining

    def missing(self) -> list[Key]:
        """Routed versions not loaded here, by model, then version in natural order."""
        served = self.repository.models()
        return sorted(
            (key for key in self.routed if key not in served),
            key=lambda key: (key[0], natural_key(key[1])),
        )

    async def set_routed(self, routed: Iterable[Key]) -> None:
        """The spec now routes traffic to `routed`: readiness follows at once."""
        async with self._health_lock:
            self.routed = frozenset(routed)
        await self.refresh_readiness()

    async def _report_versions(self, serving: bool) -> None:
        """Each loaded version SERVING (when `serving`), every other one reported before
        NOT_SERVING. Called with the health lock held."""
        loaded = {version_health_name(m, v) for m, v in self.repository.models()}
        wanted = {name: serving and name in loaded for name in loaded | set(self._versions)}
        for name, up in sorted(wanted.items()):
            if self._versions.get(name) != up:
                await self.health.set(
                    name,
                    health_pb2.HealthCheckResponse.SERVING
                    if up
                    else health_pb2.HealthCheckResponse.NOT_SERVING,
                )
                self._versions[name] = up

    async def start(self) -> int:
        port = await super().start()
        async with self._health_lock:
            self._started = True
            self._ready = True  # what the runtime just reported; correct it if versions are missing
        await self.refresh_readiness()
        return port

    async def drain(self) -> None:
        async with self._health_lock:  # a refresh under way finishes before the drain
            self._draining = True
            await self._report_versions(False)
        await super().drain()

    async def refresh_readiness(self) -> None:
        async with self._health_lock:
            if not self._started or self._draining:
                return
            await self._report_versions(True)
            missing = self.missing()
            ready = not missing
            if ready == self._ready:
                return
            if ready:
                log.info("ready: every routed version is loaded", extra={"missing": []})
            else:
                log.warning(
                    "not ready: routed versions missing",
                    extra={"missing": [_label(key) for key in missing]},
                )
            await self.set_serving(ready)
            self._ready = ready
