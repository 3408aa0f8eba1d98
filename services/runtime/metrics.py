"""Prometheus metrics every service shares: its calls by method and status, their latency,
the calls in flight, and the process's own CPU and memory, served as text on a side port
(`GET /metrics` only, with bounded connections and read time: `MetricsEndpoint`).

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
import gzip
import math
import socket
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable
from http import HTTPStatus
from itertools import accumulate
from urllib.parse import parse_qs, urlsplit

import grpc
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from servemesh.contract.wire import LATENCY_BUCKETS_S

# Seconds: from a cached feature read (0.5 ms) to a call that waited out a long deadline.
RPC_BUCKETS = LATENCY_BUCKETS_S
OK = "OK"

# The metrics endpoint's bounds (MetricsEndpoint): the only path it answers, the
# connections it holds open at once, the seconds a request's head (and the answer's
# taking) may last, and the bytes a request's line and headers may take.
METRICS_PATH = "/metrics"
METRICS_MAX_CONNECTIONS = 16
METRICS_READ_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 8192
# Seconds the endpoint's thread may take to start serving, or to stop.
STARTUP_S = 10.0


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

    def serve(
        self,
        host: str,
        port: int = 0,
        *,
        read_timeout_s: float = METRICS_READ_TIMEOUT_S,
        max_connections: int = METRICS_MAX_CONNECTIONS,
    ) -> MetricsEndpoint:
        """Serve /metrics on host:port (0: a free port) from the running event loop until
        the endpoint is closed."""
        return MetricsEndpoint(
            self.registry,
            host=host,
            port=port,
            read_timeout_s=read_timeout_s,
            max_connections=max_connections,
        )


class MetricsEndpoint:
    """/metrics over HTTP on a side port, served by an event loop of its own on one thread
    (scrapes answer whatever the service's loop is doing, and an in-process caller may
    scrape synchronously); `close` stops it.

    Bounded, since anything that reaches the port can connect: at most `max_connections`
    open at once (one beyond is closed at once, unanswered), a request's line and headers
    must arrive within `read_timeout_s` in all (a client that sends nothing, or trickles
    its headers, is dropped then) and within MAX_HEAD_BYTES, and the answer must be taken
    within `read_timeout_s` too. One request per connection. Only `GET /metrics` is
    answered (other paths 404, other methods 405), with prometheus_client's exposition
    for the `Accept` the scraper sent (Prometheus asks for OpenMetrics) and gzip when
    accepted, as its own server did; `?name[]=` restricts it as there.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        read_timeout_s: float = METRICS_READ_TIMEOUT_S,
        max_connections: int = METRICS_MAX_CONNECTIONS,
    ) -> None:
        if read_timeout_s <= 0 or max_connections < 1:
            raise ValueError("metrics endpoint: read_timeout_s > 0 and max_connections >= 1")
        self.registry = registry
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        # Connections being served now (read by tests from other threads).
        self.open_connections = 0
        self._handlers: set[asyncio.Task[None]] = set()
        # Bound and listening before the thread starts: the port is known, and connections
        # wait in the backlog until the loop takes them.
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        self._socket = socket.create_server((host, port), family=family[0][0], backlog=128)
        self.host = host
        self.port = int(self._socket.getsockname()[1])
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{self.port}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout=STARTUP_S) or self._server is None:
            self.stop()
            raise OSError(f"metrics endpoint on {self.address} did not start")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._connected, sock=self._socket, limit=MAX_HEAD_BYTES)
            )
        except BaseException:
            self._socket.close()
            loop.close()
            raise
        finally:
            self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shut())
            loop.close()

    async def _shut(self) -> None:
        if self._server is not None:
            self._server.close()
        # Connections under way end now (each closes its socket as it goes).
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def stop(self) -> None:
        """Stop serving, close every connection, and join the thread (idempotent)."""
        if self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:
                pass  # the loop closed already
            self._thread.join(timeout=STARTUP_S)

    async def close(self) -> None:
        await asyncio.to_thread(self.stop)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            if self.open_connections >= self.max_connections:
                # Closed unread and unanswered: an answer would need the request read
                # (closing on unread bytes resets the answer away), which is the holding
                # open the cap is there to bound.
                return
            self.open_connections += 1
            try:
                await self._serve_one(reader, writer)
            finally:
                self.open_connections -= 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            # The client went away, stalled or sent too much: dropped at once, whatever of
            # an answer it has not taken with it.
            writer.transport.abort()
        except asyncio.CancelledError:
            # The endpoint is closing (this task is the connection's own, awaited by no
            # one but close()): the connection goes with it.
            writer.transport.abort()
        finally:
            writer.close()
            if task is not None:
                self._handlers.discard(task)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self.read_timeout_s):
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            headers: dict[str, str] = {}
            for line in header_lines:
                name, colon, value = line.partition(":")
                if colon:
                    headers[name.strip().lower()] = value.strip()
            parts = request_line.split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                await self._answer(writer, 400, b"bad request\n")
                return
            method, target = parts[0], urlsplit(parts[1])
            # A small body (a POST's) is read and dropped, so closing the connection does
            # not reset it under the answer.
            length = headers.get("content-length", "0")
            if length.isdigit() and 0 < int(length) <= MAX_HEAD_BYTES:
                await reader.readexactly(int(length))
        if target.path != METRICS_PATH:
            await self._answer(writer, 404, b"not found: only /metrics is served here\n")
            return
        if method != "GET":
            await self._answer(
                writer, 405, b"method not allowed: GET /metrics\n", [("Allow", "GET")]
            )
            return
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        params = parse_qs(target.query)
        registry: Collector = self.registry
        if "name[]" in params:
            registry = self.registry.restricted_registry(params["name[]"])
        # Collected on this endpoint's own thread: one scrape at a time.
        body = encoder(registry)
        extra = [("Content-Type", content_type)]
        if gzip_accepted(headers.get("accept-encoding", "")):
            body = gzip.compress(body)
            extra.append(("Content-Encoding", "gzip"))
        await self._answer(writer, 200, body, extra)

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        lines = [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            *(f"{name}: {value}" for name, value in headers or [("Content-Type", "text/plain")]),
            f"Content-Length: {len(body)}",
            "Connection: close",
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        # The answer must be taken within the same bound as the request.
        async with asyncio.timeout(self.read_timeout_s):
            await writer.drain()
