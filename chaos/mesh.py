"""The mesh a drill runs against: the launcher's Mesh, plus what only drills need.

- Versions whose source is `flaky:<percent>[:<seed>]` are seeded into the registry as a
  defective build of the demo model (`chaos.canary`), for the bad-canary drill.
- Redis can be stopped and started again on the same port, from its snapshot, like any
  other child: by PID, through the launcher's single spawning thread, so `stop()` still
  stops everything.
"""

from __future__ import annotations

import signal
import time
import urllib.parse

import grpc
import redis

from servemesh.chaos.canary import FLAKY_PREFIX, flaky_artifact, parse_flaky_source
from servemesh.launcher import Mesh, MeshStartError, redis_server_binary


class DrillMesh(Mesh):
    """A Mesh that also seeds defective canary builds and can restart its Redis."""

    async def _seed_demo(self) -> None:
        await super()._seed_demo()
        await self._seed_flaky_versions()

    async def _seed_flaky_versions(self) -> None:
        from servemesh.registry.client import push_version
        from servemesh_api.registry.v1 import registry_pb2

        flaky = [
            (name, version, parse_flaky_source(v.source), model)
            for name, model in self.spec.models.items()
            for version, v in model.versions.items()
            if v.source.startswith(FLAKY_PREFIX)
        ]
        if not flaky:
            return
        limit = self.spec.limits.max_message_bytes
        options = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ]
        async with grpc.aio.insecure_channel(
            self.spec.registry_address, options=options
        ) as channel:
            for name, version, (percent, seed), model in flaky:
                artifact = flaky_artifact(percent, seed, self.spec.demo.entities)
                await push_version(
                    channel,
                    model=name,
                    version=version,
                    data=artifact.data,
                    inputs=[
                        registry_pb2.TensorSpec(
                            name="features", datatype="FP32", shape=[-1, len(model.features)]
                        )
                    ],
                    outputs=[registry_pb2.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])],
                    labels={"source": model.versions[version].source},
                )

    # --- Redis ---------------------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        url = self.spec.feature_store.redis_url
        if not url:
            raise RuntimeError("the mesh has no Redis URL yet")
        return url

    def redis_client(self, timeout_s: float = 0.5) -> redis.Redis:
        return redis.Redis.from_url(
            self.redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )

    def owns_redis(self) -> bool:
        return "redis" in self.children

    def redis_alive(self) -> bool:
        child = self.children.get("redis")
        return child is not None and child.alive()

    def stop_redis(self) -> int:
        """Snapshot the data, then SIGKILL the server (an outage, not a shutdown)."""
        if not self.owns_redis():
            raise RuntimeError("this mesh uses an external Redis; the drill will not stop it")
        child = self.children["redis"]
        if not child.alive():
            return child.pid
        client = self.redis_client()
        try:
            client.save()
        finally:
            client.close()
        self.kill("redis", signal.SIGKILL)
        return child.pid

    def start_redis(self, timeout_s: float = 15.0) -> int:
        """Start the server again on its old port; it loads the snapshot stop_redis saved."""
        old = self.children.get("redis")
        if old is not None and old.alive():
            return old.pid
        parsed = urllib.parse.urlparse(self.redis_url)
        data_dir = self.state_dir / "redis"
        argv = [
            redis_server_binary(),
            "--port", str(parsed.port),
            "--bind", str(parsed.hostname),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(data_dir),
        ]  # fmt: skip
        child = self._spawn("redis", argv)
        deadline = time.monotonic() + timeout_s
        client = self.redis_client(0.2)
        try:
            while True:
                try:
                    if client.ping():
                        return child.pid
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass
                if not child.alive() or time.monotonic() > deadline:
                    raise MeshStartError("redis did not come back; its log:\n" + child.log_tail())
                time.sleep(0.02)
        finally:
            client.close()
