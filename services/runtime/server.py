"""Server bootstrap shared by every service: health, reflection, limits, graceful drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from servemesh.contract.wire import MIN_PING_INTERVAL_MS, message_size_options
from servemesh.services.runtime.call_path import CallPath, PathServer
from servemesh.services.runtime.control_auth import ControlAuth
from servemesh.services.runtime.faults import FaultInjector
from servemesh.services.runtime.live_spec import LiveSpec, SpecHook
from servemesh.services.runtime.metrics import ServiceMetrics

log = logging.getLogger(__name__)


class _MethodAwarePool:
    """The default descriptor pool, but one that also finds the file of a method symbol.

    protobuf's upb pool cannot resolve "pkg.Service.Method", so without this
    `grpcurl describe pkg.Service.Method` answers "Symbol not found".
    """

    def __init__(self, pool: descriptor_pool.DescriptorPool) -> None:
        self._pool = pool

    def FindFileContainingSymbol(self, symbol: str) -> Any:  # noqa: N802 (protobuf's name)
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service_name, _, method = symbol.rpartition(".")
            try:
                service = self._pool.FindServiceByName(service_name)
            except KeyError:
                raise KeyError(symbol) from None
            if method not in service.methods_by_name:
                raise
            return service.file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


StopHook = Callable[[], Awaitable[None]]


class ServiceServer:
    """A grpc.aio server with health and reflection that drains on SIGTERM.

    Drain order: every health status turns NOT_SERVING (so Envoy's health checks take the
    replica out), then the server refuses new calls and finishes those in flight within
    `drain_grace_s`, then the stop hooks run (close the batcher, the Redis pool, ...).
    """

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = 4 * 1024 * 1024,
        drain_grace_s: float = 10.0,
        interceptors: list[grpc.aio.ServerInterceptor] | None = None,
        control_token: str | None = None,
        credentials: grpc.ServerCredentials | None = None,
        service: str | None = None,
    ) -> None:
        self.name = name
        # Mutual TLS on the service's port (servemesh.identity.server_credentials); None
        # serves plaintext, which only in-process tests of a bare server do.
        self.credentials = credentials
        # Calls by method and status, latency, in flight, the process's own counters; the
        # service adds its own metrics to `metrics.registry` (`service`: gateway, model...).
        self.metrics = ServiceMetrics(service or name)
        self.host = host
        self.requested_port = port
        self.drain_grace_s = drain_grace_s
        self.faults = FaultInjector()
        # Control calls answer only to the mesh's control credential (None: to nobody).
        self.control = ControlAuth(control_token)
        # Every method, the service's and health's and reflection's alike, is registered
        # wrapped in the call path (tracing, metrics, credential, faults, error statuses,
        # decoding, then the service's own `interceptors`): one wrapper built per method,
        # no grpc.aio server interceptors (call_path.py says why).
        self.call_path = CallPath(
            metrics=self.metrics,
            control=self.control,
            faults=self.faults,
            interceptors=interceptors or (),
        )
        self.server: grpc.aio.Server = PathServer(
            grpc.aio.server(
                options=[
                    *message_size_options(max_message_bytes),
                    # grpc turns SO_REUSEPORT on by default, which lets a second process
                    # bind a port already in use and silently share its traffic.
                    ("grpc.so_reuseport", 0),
                    # A gateway's health watch pings every second to notice a stalled
                    # replica (services/gateway/health.py); gRPC's default refuses pings
                    # closer than five minutes apart on a quiet connection.
                    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
                    ("grpc.http2.max_ping_strikes", 0),
                ],
            ),
            self.call_path.wrap,
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = []
        self._stop_hooks: list[StopHook] = []
        self._spec_hooks: list[SpecHook] = []
        self.live_spec: LiveSpec | None = None
        self._stopping: asyncio.Event | None = None
        self.port = 0
        # The service's own verdict on what it needs to answer (its store, its path
        # downstream); None: no deep health, SERVING from the start (see set_dependencies_ok).
        self._dependencies_ok: bool | None = None
        self._drain_begun = False
        self._verdict_lock = asyncio.Lock()

    def add_service(
        self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str
    ) -> None:
        """Register a servicer (with its generated add_*_to_server) under its full name."""
        register(servicer, self.server)
        self._service_names.append(full_name)

    def on_stop(self, hook: StopHook) -> None:
        self._stop_hooks.append(hook)

    def serve_metrics(self, port: int = 0) -> str:
        """Serve the metrics registry as Prometheus text at http://host:port/metrics (0: a
        free port) until the server stops; host:port it listens on."""
        endpoint = self.metrics.serve(self.host, port)
        # Registered now, so it closes after the hooks registered later: a scrape during
        # the drain still sees the last counts.
        self.on_stop(endpoint.close)
        log.info("metrics endpoint", extra={"address": f"http://{endpoint.address}/metrics"})
        return endpoint.address

    def watch_faults(self, control: Path) -> None:
        """Follow a fault control file (drills and tests inject errors and delays with it)."""
        task = asyncio.get_running_loop().create_task(self.faults.watch(control))

        async def stop_watching() -> None:
            task.cancel()

        self.on_stop(stop_watching)

    def run_in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on the server's loop until the server stops (then it is cancelled)."""
        task = asyncio.get_running_loop().create_task(work)

        async def stop_it() -> None:
            task.cancel()

        self.on_stop(stop_it)

    def on_spec_change(self, hook: SpecHook) -> None:
        """Call `hook(new_spec)` whenever the followed spec file changes (see `follow_spec`)."""
        self._spec_hooks.append(hook)
        if self.live_spec is not None:
            self.live_spec.on_change(hook)

    def follow_spec(self, live: LiveSpec) -> None:
        """Poll `live`'s file until the server stops; registered hooks see each change."""
        self.live_spec = live
        for hook in self._spec_hooks:
            live.on_change(hook)
        task = asyncio.get_running_loop().create_task(live.watch())

        async def stop_following() -> None:
            task.cancel()

        self.on_stop(stop_following)

    async def start(self) -> int:
        names = [*self._service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection(
            [*names, reflection.SERVICE_NAME],
            self.server,
            pool=_MethodAwarePool(descriptor_pool.Default()),
        )
        address = f"{self.host}:{self.requested_port}"
        if self.credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.credentials)
        if not self.port:
            raise OSError(f"{self.name}: cannot bind {self.host}:{self.requested_port}")
        await self.server.start()
        async with self._verdict_lock:
            await self.set_serving(self._dependencies_ok is not False)
        log.info("serving", extra={"port": self.port, "services": self._service_names})
        if self.control.token is None:
            log.warning("no control credential: every control call will be refused")
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    def expect_dependency_check(self) -> None:
        """Report NOT_SERVING from the start until the first `set_dependencies_ok(True)`
        (a service with deep health calls this while it is built)."""
        if self._dependencies_ok is None:
            self._dependencies_ok = False

    async def set_dependencies_ok(self, ok: bool) -> None:
        """The service's verdict on its dependencies: the health service (overall and every
        service name) says SERVING only while it is True; once draining, nothing turns it
        SERVING again. Before `start` the verdict is kept for start to report."""
        async with self._verdict_lock:
            self._dependencies_ok = ok
            if self.port and not self._drain_begun:
                await self.set_serving(ok)

    async def drain(self) -> None:
        if self._stopping is not None and self._stopping.is_set():
            return
        log.info("draining", extra={"grace_s": self.drain_grace_s})
        async with self._verdict_lock:
            self._drain_begun = True
            await self.set_serving(False)
        await self.server.stop(self.drain_grace_s)
        for hook in reversed(self._stop_hooks):
            try:
                await hook()
            except Exception:  # one failing hook must not keep the others from running
                log.exception("stop hook failed")
        log.info("stopped")
        if self._stopping is not None:
            self._stopping.set()

    async def serve_until_signalled(self) -> None:
        """Start, then block until SIGTERM/SIGINT has drained the server."""
        self._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        drain_task: list[asyncio.Task[None]] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: drain_task.append(loop.create_task(self.drain())))
        if not self.port:
            await self.start()
        await self._stopping.wait()


def run_service(build: Callable[[], Awaitable[ServiceServer]]) -> None:
    """Entry point helper: build the server inside the loop, serve until signalled."""

    async def main() -> None:
        server = await build()
        await server.serve_until_signalled()

    asyncio.run(main())
