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

The serving path does a dictionary lookup, two perf_counter reads, a bisect and a few
additions on plain numbers per call (`MethodMetrics`); the families are built from them
when scraped (`RpcCollector`).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable
from itertools import accumulate
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from servemesh.wire import LATENCY_BUCKETS_S

# Seconds: from a cached feature read (0.5 ms) to a call that waited out a long deadline.
RPC_BUCKETS = LATENCY_BUCKETS_S
OK = "OK"


class MethodMetrics:
    """One method's call counts, latency histogram and calls in flight, as plain numbers:
    a call costs two perf_counter reads, a bisect and a few additions (prometheus_client's
    labelled children took a lock per update, ~6 µs a call). `RpcCollector` turns them
    into the Prometheus families at scrape time."""

    __slots__ = ("buckets", "by_code", "created", "in_flight", "seconds")

    def __init__(self) -> None:
        self.in_flight = 0
        # Calls by status name; latency counts per bucket of RPC_BUCKETS (not cumulative),
        # the last one past the largest bound; their seconds summed.
        self.by_code: dict[str, int] = {}
        self.buckets = [0] * (len(RPC_BUCKETS) + 1)
        self.seconds = 0.0
        self.created = time.time()

    def begin(self) -> float:
        """A call of the method arrived: it is in flight from now (the returned time)."""
        self.in_flight += 1
        return time.perf_counter()

    def end(self, started: float, code: str) -> None:
        """The call that began at `started` is answered with status `code`."""
        elapsed = time.perf_counter() - started
        self.in_flight -= 1
        # bisect_left: the first bound >= elapsed, Prometheus's `le`.
        self.buckets[bisect_left(RPC_BUCKETS, elapsed)] += 1
        self.seconds += elapsed
        by_code = self.by_code
        by_code[code] = by_code.get(code, 0) + 1


class RpcCollector(Collector):
    """The RPC families of one service's methods, read from their MethodMetrics when
    scraped (from the endpoint's thread: each read is a copy made in one step)."""

    def __init__(self, service: str, methods: dict[str, MethodMetrics]) -> None:
        self.service = service
        self.methods = methods
        self._bounds = [floatToGoString(bound) for bound in (*RPC_BUCKETS, math.inf)]

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        requests, duration, in_flight = families
        for method, bound in list(self.methods.items()):
            labels = [self.service, method]
            for code, count in list(bound.by_code.items()):
                requests.add_metric([*labels, code], count, created=bound.created)
            cumulative = accumulate(list(bound.buckets))
            buckets = list(zip(self._bounds, cumulative, strict=True))
            duration.add_metric(labels, buckets, bound.seconds)
            in_flight.add_metric(labels, bound.in_flight)
        return families

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, HistogramMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(
                "servemesh_rpc_requests",
                "Calls answered, by method and the status code the caller saw.",
                labels=["service", "method", "code"],
            ),
            HistogramMetricFamily(
                "servemesh_rpc_duration_seconds",
                "Seconds from a call's arrival at the service to its answer, by method.",
                labels=["service", "method"],
            ),
            GaugeMetricFamily(
                "servemesh_rpc_in_flight",
                "Calls being answered now, by method.",
                labels=["service", "method"],
            ),
        )


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
        self._methods: dict[str, MethodMetrics] = {}
        self.registry.register(RpcCollector(service, self._methods))

    def method(self, method: str) -> MethodMetrics:
        """The metrics of `method` (made on its first call)."""
        found = self._methods.get(method)
        if found is None:
            found = self._methods[method] = MethodMetrics()
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
