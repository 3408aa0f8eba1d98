"""Prometheus metrics every service shares: its calls by method and status, their latency,
the calls in flight, and the process's own CPU and memory, served as text on a side port.

Each `ServiceServer` has a `ServiceMetrics` of its own (its own CollectorRegistry, not the
process-global one, so several servers can live in one process, as in the tests); a
service adds its own metrics (the gateway per model, the feature service per view, the
registry per operation, the model server's batchers) to the same registry, and one HTTP
endpoint serves them all.

| metric | type | labels |
| --- | --- | --- |
| servemesh_rpc_requests_total | counter | service, method, code |
| servemesh_rpc_duration_seconds | histogram | service, method |
| servemesh_rpc_in_flight | gauge | service, method |
| process_cpu_seconds_total, process_resident_memory_bytes, ... | process collector | |

`service` is the mesh's kind of service (gateway, feature, model, registry), `method` the
full gRPC method path (/servemesh.gateway.v1.Gateway/Predict), `code` the status name the
caller saw (OK, INVALID_ARGUMENT, ...), including the call path's own refusals (control
credential, injected faults, undecodable bodies).

The serving path does a dictionary lookup, two perf_counter reads, a gauge up and down,
a counter increment and a histogram observation per call, all on label children bound
once per method (docs/observability.md has its measured cost).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from servemesh.wire import LATENCY_BUCKETS_S

# Seconds: from a cached feature read (0.5 ms) to a call that waited out a long deadline.
RPC_BUCKETS = LATENCY_BUCKETS_S
OK = "OK"


@dataclass
class MethodMetrics:
    """The label children of one method, bound once: the hot path does no label lookups
    beyond one dictionary access per call (and one more per status code seen)."""

    duration: Any
    in_flight: Any
    requests: Callable[[str], Any]
    by_code: dict[str, Any] = field(default_factory=dict)

    def count(self, code: str) -> None:
        child = self.by_code.get(code)
        if child is None:
            child = self.by_code[code] = self.requests(code)
        child.inc()

    def begin(self) -> float:
        """A call of the method arrived: it is in flight from now (the returned time)."""
        self.in_flight.inc()
        return time.perf_counter()

    def end(self, started: float, code: str) -> None:
        """The call that began at `started` is answered with status `code`."""
        self.duration.observe(time.perf_counter() - started)
        self.in_flight.dec()
        self.count(code)


def code_of(context: grpc.aio.ServicerContext) -> str:
    """The status a handler chose (abort or set_code); OK when it chose none."""
    code = context.code()
    if code is None:
        return OK
    if isinstance(code, grpc.StatusCode):
        return code.name
    # grpc.aio keeps the integer value of the status when set through the C core.
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return "UNKNOWN"


class ServiceMetrics:
    """One service's registry: the RPC metrics (recorded by the server's call path through
    `method`), the process collector, and whatever the service adds; `serve` puts it on
    an HTTP port."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self._requests = Counter(
            "servemesh_rpc_requests",
            "Calls answered, by method and the status code the caller saw.",
            ["service", "method", "code"],
            registry=self.registry,
        )
        self._duration = Histogram(
            "servemesh_rpc_duration_seconds",
            "Seconds from a call's arrival at the service to its answer, by method.",
            ["service", "method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self._in_flight = Gauge(
            "servemesh_rpc_in_flight",
            "Calls being answered now, by method.",
            ["service", "method"],
            registry=self.registry,
        )
        self._methods: dict[str, MethodMetrics] = {}

    def method(self, method: str) -> MethodMetrics:
        """The bound children of `method` (bound on its first call)."""
        found = self._methods.get(method)
        if found is None:
            service = self.service
            requests = self._requests

            def by_code(code: str) -> Any:
                return requests.labels(service, method, code)

            found = self._methods[method] = MethodMetrics(
                duration=self._duration.labels(service, method),
                in_flight=self._in_flight.labels(service, method),
                requests=by_code,
            )
        return found

    def serve(self, host: str, port: int = 0) -> MetricsEndpoint:
        """Serve /metrics on host:port (0: a free port) until the endpoint is closed."""
        return MetricsEndpoint(self.registry, host=host, port=port)


class MetricsEndpoint:
    """/metrics over HTTP on a side port, served from a thread; `close` stops it."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def close(self) -> None:
        # shutdown() waits out the server's poll interval: not on the event loop.
        await asyncio.to_thread(self._server.shutdown)
        self._server.server_close()
        self._thread.join(timeout=5)
