"""A service's /metrics endpoint, against a real server on loopback: it answers `GET
/metrics` with the exposition Prometheus scrapes and nothing else, holds a bounded number
of connections, and drops a client that sends nothing, trickles its headers or sends too
much, within the injected read timeout.

The endpoint serves from a thread and event loop of its own; the clients here are asyncio
streams on the test's loop, or urllib on a worker thread.
"""

from __future__ import annotations

import asyncio
import gzip
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from servemesh.observe.scrape import sample, scrape
from servemesh.services.runtime.metrics import MetricsEndpoint, ServiceMetrics
from tests.waiting import wait_until_async

PREDICT = "/servemesh.gateway.v1.Gateway/Predict"
# Far above what any step here takes on a busy machine: a hang fails, never a slow run.
BOUND_S = 20.0


async def _endpoint(read_timeout_s: float = 5.0, max_connections: int = 16) -> MetricsEndpoint:
    metrics = ServiceMetrics("gateway")
    bound = metrics.method(PREDICT)
    bound.end(bound.begin(), "OK")
    return metrics.serve(
        "127.0.0.1", 0, read_timeout_s=read_timeout_s, max_connections=max_connections
    )


@pytest.fixture
async def endpoint() -> AsyncIterator[MetricsEndpoint]:
    served = await _endpoint()
    try:
        yield served
    finally:
        await served.close()


async def _exchange(endpoint: MetricsEndpoint, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `request` raw, read the whole answer (the endpoint closes after one)."""
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), BOUND_S)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
    return int(status_line.split(" ")[1]), headers, body


async def _closed_within(reader: asyncio.StreamReader, bound_s: float) -> bytes:
    """What the server sent before closing the connection (it must close within bound_s)."""
    try:
        return await asyncio.wait_for(reader.read(), bound_s)
    except ConnectionResetError:
        return b""


async def test_get_metrics_is_the_exposition_prometheus_scrapes(endpoint: MetricsEndpoint) -> None:
    samples = await asyncio.to_thread(scrape, endpoint.address)
    labels = {"service": "gateway", "method": PREDICT, "code": "OK"}
    assert sample(samples, "servemesh_rpc_requests_total", labels) == 1
    assert sample(samples, "process_cpu_seconds_total") > 0

    # Prometheus asks for OpenMetrics and gzip; it gets both, as from prometheus_client's
    # own server; `name[]` restricts the families.
    status, headers, body = await _exchange(
        endpoint,
        b"GET /metrics?name[]=servemesh_rpc_requests_total HTTP/1.1\r\nHost: t\r\n"
        b"Accept: application/openmetrics-text;version=1.0.0;q=0.5,text/plain;q=0.1\r\n"
        b"Accept-Encoding: gzip\r\n\r\n",
    )
    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert headers["content-encoding"] == "gzip"
    text = gzip.decompress(body).decode()
    assert text.endswith("# EOF\n")
    assert {f.name for f in text_string_to_metric_families(text)} == {"servemesh_rpc_requests"}


@pytest.mark.parametrize("path", ["/", "/metricsx", "/metrics/", "/debug/pprof", "/favicon.ico"])
async def test_other_paths_are_not_found(endpoint: MetricsEndpoint, path: str) -> None:
    status, _, body = await _exchange(endpoint, f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    assert status == 404
    assert b"servemesh_rpc" not in body
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(
            urllib.request.urlopen, f"http://{endpoint.address}{path}", timeout=BOUND_S
        )
    assert refused.value.code == 404
    refused.value.close()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "HEAD", "OPTIONS"])
async def test_other_methods_are_not_allowed(endpoint: MetricsEndpoint, method: str) -> None:
    request = f"{method} /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbody"
    status, headers, body = await _exchange(endpoint, request.encode())
    assert status == 405
    assert headers["allow"] == "GET"
    assert b"servemesh_rpc" not in body


async def test_a_malformed_request_line_is_a_bad_request(endpoint: MetricsEndpoint) -> None:
    status, _, _ = await _exchange(endpoint, b"GET\r\n\r\n")
    assert status == 400


async def test_connections_beyond_the_cap_are_refused_until_idle_ones_time_out() -> None:
    endpoint = await _endpoint(read_timeout_s=1.5, max_connections=2)
    idle = [await asyncio.open_connection(endpoint.host, endpoint.port) for _ in range(2)]
    try:
        await wait_until_async(lambda: endpoint.open_connections == 2, "two idle connections held")
        # The one beyond the cap, even a well-formed scrape, is closed unanswered.
        for request in (b"", b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n"):
            reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
            writer.write(request)
            assert await _closed_within(reader, BOUND_S) == b""
            writer.close()
        assert endpoint.open_connections == 2

        # The idle ones are dropped once their read timeout passes, sent nothing.
        for idle_reader, _ in idle:
            assert await _closed_within(idle_reader, BOUND_S) == b""
        await wait_until_async(lambda: endpoint.open_connections == 0, "idle ones dropped")
        samples = await asyncio.to_thread(scrape, endpoint.address)
        assert sample(samples, "servemesh_rpc_requests_total") == 1
    finally:
        for _, idle_writer in idle:
            idle_writer.close()
        await endpoint.close()


async def test_a_client_that_never_finishes_its_headers_is_closed_within_the_timeout() -> None:
    endpoint = await _endpoint(read_timeout_s=1.0)
    try:
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: t\r\n")
        began = time.monotonic()
        # A byte of a header line every 0.2 s, never the blank line that ends the head: no
        # single read waits the timeout out, the head as a whole does.
        closed = False
        while not closed and time.monotonic() - began < BOUND_S:
            try:
                writer.write(b"X")
                await writer.drain()
                closed = await asyncio.wait_for(reader.read(1), 0.2) == b""
            except TimeoutError:
                continue
            except ConnectionError:
                closed = True
        took = time.monotonic() - began
        writer.close()
        assert closed, "the trickling client was never closed"
        assert 0.9 <= took < 1.0 + 5.0, took
        # And the endpoint still answers.
        assert await asyncio.to_thread(scrape, endpoint.address)
    finally:
        await endpoint.close()


async def test_a_head_beyond_the_size_bound_is_dropped(endpoint: MetricsEndpoint) -> None:
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 64 * 1024)
        await writer.drain()
    except ConnectionError:
        pass
    assert await _closed_within(reader, BOUND_S) == b""
    writer.close()


async def test_close_drops_connections_under_way() -> None:
    endpoint = await _endpoint(read_timeout_s=60.0)
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    await wait_until_async(lambda: endpoint.open_connections == 1, "the connection held")
    await asyncio.wait_for(endpoint.close(), BOUND_S)
    assert await _closed_within(reader, BOUND_S) == b""
    writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection(endpoint.host, endpoint.port)
