"""A model replica's health follows the versions the mesh routes traffic to, and runs them.

**Readiness.** The replica reports NOT_SERVING (overall, `wire.READINESS_HEALTH_NAME` and
the OIP service) while any routed version, one with weight > 0 in `models.<m>.traffic` or
a shadow target, is not loaded on it or fails its readiness check (`checks`: sample rows
through the version's own worker thread every `CHECK_INTERVAL_S`, outputs of the declared
shape and finite). A version counts as loaded only after loading ran it through its
batcher (the warm-up in `loader.load_model`) and its first check passed. Draining
(SIGTERM) turns the replica NOT_SERVING for good.

Each version also has a health status of its own, under `wire.version_health_name`:
SERVING exactly while that version is loaded (and warmed up), its last check passed, and
the replica is not draining. Envoy's cluster of a version health-checks that name, so it
routes a version only to the replicas that hold it and answer numbers with it. A loaded
version nothing routes to yet (a `servemesh apply` that loads before it routes) fails only
its own name: apply waits for that name and refuses a version that never turns SERVING,
and the replica keeps serving the versions it is routed, rather than every replica
leaving the mesh (and the gateways with them) over a canary. The routed set follows the
live spec (`set_routed`).

**On-demand pools** (`on_demand`): a version the server may load on its first call is
*loadable*, not missing. It does not hold readiness back, and its own name is SERVING while
the replica is (Envoy keeps routing its calls here, and the call loads it); once loaded it
is checked as any version, and fails its name and the replica's readiness as any would.
An evicted version is loadable again. So a server whose versions are merely not loaded yet
is ready.

**Liveness** (`wire.LIVENESS_HEALTH_NAME`) is SERVING while the event loop answers and no
model thread is stuck (`checks.WORKER_STALL_S`); outputs that fail the check never touch
it, and a drain leaves it SERVING (the process is alive, finishing its calls).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from grpc_health.v1 import health_pb2

from servemesh.contract.wire import LIVENESS_HEALTH_NAME, READINESS_HEALTH_NAME, version_health_name
from servemesh.services.model.checks import (
    CHECK_INTERVAL_S,
    CHECK_TIMEOUT_S,
    WORKER_STALL_S,
    ModelChecks,
)
from servemesh.services.model.metrics import add_check_metrics
from servemesh.services.model.repository import Key, ModelRepository, natural_key
from servemesh.services.runtime import ServiceServer
from servemesh.spec import MeshSpec

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


def _status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


class ModelServer(ServiceServer):
    """A ServiceServer that is SERVING only while every routed version is loaded and passes
    its readiness check, with a liveness answer of its own (module docstring).

    Readiness is recomputed when the server starts, after every load and unload of
    `repository`, and after every round of checks (every `check_interval_s`); once
    draining has begun nothing turns it SERVING again.
    """

    def __init__(
        self,
        name: str,
        *,
        repository: ModelRepository,
        routed: Iterable[Key],
        check_interval_s: float = CHECK_INTERVAL_S,
        check_timeout_s: float = CHECK_TIMEOUT_S,
        stall_s: float = WORKER_STALL_S,
        **options: Any,
    ) -> None:
        super().__init__(name, **options)
        self.repository = repository
        self.routed: frozenset[Key] = frozenset(routed)
        self.check_interval_s = check_interval_s
        self.checks = ModelChecks(timeout_s=check_timeout_s, stall_s=stall_s)
        self._health_lock = asyncio.Lock()
        self._started = False
        self._draining = False
        self._ready: bool | None = None
        self._alive: bool | None = None
        # Per-version health as last reported: name -> serving.
        self._versions: dict[str, bool] = {}
        repository.on_change(self.refresh_readiness)
        add_check_metrics(self.metrics.registry, self)

    @property
    def draining(self) -> bool:
        return self._draining

    def is_ready(self) -> bool:
        """What the health service says now: started, every routed version loaded and
        passing its check, and not draining (OIP ServerReady answers the same)."""
        return self._ready is True and not self._draining

    def is_alive(self) -> bool:
        """What the liveness name says now (True before the first round of checks)."""
        return self._alive is not False

    def missing(self) -> list[Key]:
        """Routed versions not loaded here (and not loadable on a call), by model, then
        version in natural order."""
        served = self.repository.models()
        return sorted(
            (
                key
                for key in self.routed
                if key not in served and not self.repository.is_loadable(key)
            ),
            key=lambda key: (key[0], natural_key(key[1])),
        )

    def failing(self) -> list[Key]:
        """Loaded versions whose last readiness check failed (or that have none yet)."""
        return sorted(
            (key for key in self.repository.models() if not self.checks.passing(key)),
            key=lambda key: (key[0], natural_key(key[1])),
        )

    async def set_serving(self, serving: bool) -> None:
        # The readiness name says what the overall name says, drains included.
        await super().set_serving(serving)
        await self.health.set(READINESS_HEALTH_NAME, _status(serving))

    async def set_routed(self, routed: Iterable[Key]) -> None:
        """The spec now routes traffic to `routed`: readiness follows at once."""
        async with self._health_lock:
            self.routed = frozenset(routed)
        await self.refresh_readiness()

    async def _report_versions(self, serving: bool) -> None:
        """Each loaded version whose check passes SERVING (when `serving`), every other one
        reported before NOT_SERVING. Called with the health lock held."""
        loaded = {
            version_health_name(m, v): self.checks.passing((m, v))
            for m, v in self.repository.models()
        }
        # On demand, a version not loaded answers its calls by loading: SERVING too.
        models = self.repository.models()
        for key in self.repository.loadable:
            if key not in models:
                loaded[version_health_name(*key)] = True
        wanted = {
            name: serving and loaded.get(name, False)
            for name in loaded.keys() | set(self._versions)
        }
        for name, up in sorted(wanted.items()):
            if self._versions.get(name) != up:
                await self.health.set(name, _status(up))
                self._versions[name] = up

    async def start(self) -> int:
        # Every version loaded at build is checked before the port opens, so the first
        # answer the health service gives already counts them.
        await self.checks.run(self.repository.models())
        port = await super().start()
        async with self._health_lock:
            self._started = True
            self._ready = True  # what the runtime just reported; correct it if versions are missing
        await self._set_alive(True)
        await self.refresh_readiness()
        self.run_in_background(self._check_periodically())
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
            models = self.repository.models()
            self.checks.keep(set(models))
            # A version just loaded is checked before its health first says SERVING.
            fresh = {key: m for key, m in models.items() if not self.checks.checked(key, m)}
            await self.checks.run(fresh)
            await self._report_versions(True)
            missing = self.missing()
            failing = [key for key in self.failing() if key in self.routed]
            ready = not missing and not failing
            if ready == self._ready:
                return
            if ready:
                # The message predates the checks (log alerts match it): loaded means
                # loaded and passing now.
                log.info("ready: every routed version is loaded", extra={"missing": []})
            else:
                log.warning(
                    "not ready: routed versions missing"
                    if missing
                    else "not ready: routed versions fail their readiness check",
                    extra={
                        "missing": [_label(key) for key in missing],
                        "failing": [_label(key) for key in failing],
                    },
                )
            await self.set_serving(ready)
            self._ready = ready

    async def check_now(self) -> None:
        """One round: check every loaded version, then report readiness and liveness."""
        if self._draining:
            return
        models = self.repository.models()
        # Outside the health lock: a hung model's check waits up to its timeout, and loads,
        # unloads and spec changes must not wait behind it.
        await self.checks.run(models)
        await self._set_alive(not self.checks.stalled(self.repository.models()))
        await self.refresh_readiness()

    async def _check_periodically(self) -> None:
        while not self._draining:
            await asyncio.sleep(self.check_interval_s)
            try:
                await self.check_now()
            except Exception:  # a bug here must not end the checks (or liveness) for good
                log.exception("model checks failed")

    async def _set_alive(self, alive: bool) -> None:
        if alive == self._alive:
            return
        if self._alive is not None:
            if alive:
                log.info("alive: every model thread answers again")
            else:
                log.error(
                    "not alive: a model thread is stuck",
                    extra={
                        "stuck": {
                            _label(key): round(seconds, 1)
                            for key, seconds in self.checks.stalled(self.repository.models())
                        }
                    },
                )
        self._alive = alive
        await self.health.set(LIVENESS_HEALTH_NAME, _status(alive))
