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
from pathlib import Path

import redis

from servemesh.chaos.canary import FLAKY_PREFIX, flaky_artifact, parse_flaky_source
from servemesh.netns import ZoneNetwork
from servemesh.netns import available as netns_available
from servemesh.launcher import Child, Mesh, MeshStartError, redis_server_binary
from servemesh.proxy.render import EnvoyResources
from servemesh.spec import MeshSpec


class DrillMesh(Mesh):
    """A Mesh that also seeds defective canary builds and can restart its Redis.

    With `network` set (a created ZoneNetwork), the gateway, feature and model processes of
    each zone run inside that zone's network namespace; Envoy, the registry and Redis stay
    on the machine. Everything keeps its loopback addresses (the network's NAT carries them
    across), and each zone's Envoy clusters send from a loopback source of their own, so
    the zones' namespaces see which zone a proxied call speaks for and a partition between
    two zones cuts exactly the traffic between them.
    """

    network: ZoneNetwork | None = None
    _network_ready: bool = False

    def _spawn(self, name: str, argv: list[str], health_address: str | None = None) -> Child:
        zone = self._zone_service(name)
        if self.network is not None and zone is not None:
            self._join_network()
            argv = self.network.exec_argv(zone, argv)
        return super()._spawn(name, argv, health_address)

    def stop(self) -> None:
        """Stop every child, then remove the zones' namespaces (after their processes)."""
        try:
            super().stop()
        finally:
            if self.network is not None:
                self.network.close()

    def _zone_service(self, name: str) -> str | None:
        """The zone of a gateway, feature or model instance; None for everything else."""
        for inst in self.spec.instances():
            if inst.name == name:
                return inst.zone if inst.service != "registry" else None
        return None

    def _join_network(self) -> None:
        if self._network_ready or self.network is None:
            return
        spec = self.spec
        zone_ports: dict[str, list[int]] = {zone: [] for zone in spec.zones}
        for inst in spec.instances():
            if inst.service != "registry":
                zone_ports[inst.zone].append(spec.port_of(inst.name))
                if inst.name in spec.metrics_ports:
                    zone_ports[inst.zone].append(spec.metrics_ports[inst.name])
        host_ports = [*spec.mesh_ports.values(), spec.port_of("registry-0"), spec.ports.edge]
        if spec.feature_store.redis_url:
            port = urllib.parse.urlparse(spec.feature_store.redis_url).port
            if port:
                host_ports.append(port)
        self.network.attach_host(zone_ports, host_ports)
        self._network_ready = True

    def _write_envoy_config(self) -> None:
        if self.network is None:
            return super()._write_envoy_config()
        # Each zone's clusters (`*-via-<zone>`) send from a loopback address of their own.
        import servemesh.launcher as launcher_module

        render = launcher_module.render_resources
        zones = list(self.spec.zones)

        def with_sources(spec: MeshSpec, logs: Path) -> EnvoyResources:
            resources = render(spec, logs)
            for cluster in resources.clusters:
                for index, zone in enumerate(zones):
                    if str(cluster.get("name", "")).endswith(f"-via-{zone}"):
                        address = ZoneNetwork.loopback_source(index)
                        cluster["upstream_bind_config"] = {
                            "source_address": {"address": address, "port_value": 0}
                        }
            return resources

        launcher_module.render_resources = with_sources  # type: ignore[assignment]
        try:
            super()._write_envoy_config()
        finally:
            launcher_module.render_resources = render

    async def _seed_demo(self) -> None:
        await super()._seed_demo()
        await self._seed_flaky_versions()

    async def _seed_flaky_versions(self) -> None:
        from servemesh.demo import demo_signature
        from servemesh.registry.client import push_version

        flaky = [
            (name, version, parse_flaky_source(v.source), model)
            for name, model in self.spec.models.items()
            for version, v in model.versions.items()
            if v.source.startswith(FLAKY_PREFIX)
        ]
        if not flaky:
            return
        async with self.registry_channel() as channel:
            for name, version, (percent, seed), model in flaky:
                artifact = flaky_artifact(percent, seed, self.spec.demo.entities)
                await push_version(
                    channel,
                    model=name,
                    version=version,
                    data=artifact.data,
                    **demo_signature(len(model.features)),
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


def zone_namespace_mesh(spec: MeshSpec, state_dir: Path | None = None) -> DrillMesh:
    """A mesh whose zones each run their services in a network namespace of their own
    (`servemesh up --netns`); raises MeshStartError saying why when this machine cannot."""
    can, why = netns_available()
    if not can:
        raise MeshStartError(f"zones in network namespaces are not possible here: {why}")
    mesh = DrillMesh.from_spec(spec, state_dir)
    mesh.network = ZoneNetwork(list(spec.zones)).create()
    return mesh
