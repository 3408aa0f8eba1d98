"""The mesh a drill runs against: the launcher's Mesh, plus what only drills need.

- Versions whose source is `flaky:<percent>[:<seed>]` are seeded into the registry as a
  defective build of the demo model (`chaos.canary`), for the bad-canary drill, and those
  whose source is `shifted:<delta>[:<seed>]` as the demo model with its scores moved (the
  distribution check's bad canary): one more seed step after the launcher's demo seeding.
- Envoy runs the drill profile (`traffic.runtime_overrides`): route faults and shadow
  shares are runtime keys the drill sets through the admin API, which a mesh without the
  profile refuses.
- Redis can be stopped (snapshot, SIGKILL: an outage) and started again on the same port,
  from its snapshot, through the mesh's supervisor, so `stop()` still stops everything.

Zones in network namespaces are the spec's business (`network: {mode: netns}`): the
launcher does it for any mesh, the drill only sets the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import grpc
import redis

from servemesh.chaos.canary import (
    FLAKY_PREFIX,
    SHIFTED_PREFIX,
    flaky_artifact,
    parse_flaky_source,
    parse_shifted_source,
    shifted_artifact,
)
from servemesh.launcher import Mesh
from servemesh.procs import RedisServer
from servemesh.seeding import SeedStep, push_seed_version
from servemesh.spec import MeshSpec


async def seed_flaky_versions(spec: MeshSpec, registry: grpc.aio.Channel) -> None:
    """Push every `flaky:` and `shifted:` version as the defective canary build it names."""
    from servemesh.contract.demo import demo_signature

    for name, model in spec.models.items():
        for version, version_spec in model.versions.items():
            source = version_spec.source
            if source.startswith(FLAKY_PREFIX):
                percent, seed = parse_flaky_source(source)
                data = flaky_artifact(percent, seed, spec.demo.entities).data
            elif source.startswith(SHIFTED_PREFIX):
                delta, seed = parse_shifted_source(source)
                data = shifted_artifact(delta, seed).data
            else:
                continue
            await push_seed_version(
                spec,
                registry,
                model=name,
                version=version,
                data=data,
                signature=demo_signature(len(model.features)),
                source=source,
            )


@dataclass
class DrillMesh(Mesh):
    """A Mesh that also seeds defective canary builds and can take its Redis down."""

    seed_steps: list[SeedStep] = field(default_factory=lambda: [seed_flaky_versions])

    @classmethod
    def from_spec(
        cls, spec: MeshSpec, state_dir: Path | None = None, *, seed_steps: Sequence[SeedStep] = ()
    ) -> Self:
        # Drills inject route faults through Envoy's runtime: every drill mesh has the
        # drill profile, whatever the spec file says.
        traffic = spec.traffic.model_copy(update={"runtime_overrides": True})
        drill_spec = spec.model_copy(update={"traffic": traffic})
        return super().from_spec(drill_spec, state_dir, seed_steps=seed_steps)

    @property
    def redis_url(self) -> str:
        return self.spec.redis_url

    def redis_client(self, timeout_s: float = 0.5) -> redis.Redis:
        return redis.Redis.from_url(
            self.redis_url,
            password=self.spec.redis_password(),
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
        )

    def owns_redis(self) -> bool:
        return self.redis is not None

    def redis_alive(self) -> bool:
        return self.redis is not None and self.redis.is_running()

    def _own_redis(self) -> RedisServer:
        if self.redis is None:
            raise RuntimeError("this mesh uses an external Redis; the drill will not stop it")
        return self.redis

    def stop_redis(self) -> int:
        """Snapshot the data, then SIGKILL the server (an outage, not a shutdown); its PID."""
        return self._own_redis().outage()

    def start_redis(self, timeout_s: float = 15.0) -> int:
        """Start the server again on its old port; it loads the snapshot stop_redis saved."""
        return self._own_redis().start(timeout_s)
