"""One client cannot starve the edge: each limit observed on a real Envoy.

Long-lived streams (health Watch, reflection) have a route and a breaker of their own, so
a client holding thousands of them leaves Predicts alone; each listener has its own
connection cap, handshakes and request headers have deadlines, and the edge's rate limit
keeps a bucket per caller, so one flooding client is shed while another gets through.

The stream test runs against the whole mesh (the issue's scenario); the others against
`front` (tests/mesh/test_edge_hardening.py): a real Envoy rendered from a spec in front of
a recording stand-in for every service.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2

from servemesh.identity import Dial, dial_edge
from servemesh.launcher import Mesh
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.render import GATEWAY_STREAMS_CLUSTER
from servemesh.spec.policy import ConnectionLimits, RateLimit, TrafficSpec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.test_edge_hardening import (
    HEALTH_WATCH,
    MODEL_INFER,
    PREDICT,
    FrontFactory,
    _call,
)
from tests.mesh.test_edge_hardening import front_factory as front_factory  # the fixture
from tests.waiting import wait_until

pytestmark = pytest.mark.mesh

# --- long-lived streams ------------------------------------------------------------------

HELD_STREAMS = 2000
# Envoy's edge allows 100 streams per client connection: 25 connections of 80 streams.
STREAM_CHANNELS = 25
PREDICTS = 40


async def _hold_watches_and_predict(
    dial: Dial, streams: int, channels: int
) -> tuple[int, int, list[grpc.StatusCode]]:
    """Open `streams` health Watch streams over `channels` connections and hold them;
    meanwhile send PREDICTS Predicts on a connection of their own. (held, refused,
    Predict codes); every stream is cancelled and every channel closed before returning."""
    # Each channel its own connection (grpc would otherwise share one among equal channels).
    own = (("grpc.use_local_subchannel_pool", 1),)
    opened = [dial.aio_channel(options=own) for _ in range(channels)]
    calls = []
    try:
        request = health_pb2.HealthCheckRequest().SerializeToString()
        for i in range(streams):
            watch = opened[i % channels].unary_stream(HEALTH_WATCH)
            calls.append(watch(request, timeout=120))

        async def first(call: grpc.aio.UnaryStreamCall) -> bool:
            try:
                return await asyncio.wait_for(call.read(), 60) is not grpc.aio.EOF
            except grpc.aio.AioRpcError:
                return False

        answered = await asyncio.gather(*(first(c) for c in calls))
        held = [c for c, ok in zip(calls, answered, strict=True) if ok]
        refused = [c for c, ok in zip(calls, answered, strict=True) if not ok]
        refused_codes = {await c.code() for c in refused}
        assert refused_codes <= {grpc.StatusCode.UNAVAILABLE}, refused_codes
        # Still open while the Predicts run.
        assert not any(c.done() for c in held)
        codes = []
        async with dial.aio_channel(options=own) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for i in range(PREDICTS):
                try:
                    await stub.Predict(
                        gateway_pb2.PredictRequest(model="fraud", entity_ids=[f"user-{i}"]),
                        timeout=20,
                    )
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
        assert sum(1 for c in held if not c.done()) == len(held)
        return len(held), len(refused), codes
    finally:
        for call in calls:
            call.cancel()
        for channel in opened:
            await channel.close()


def test_holding_2000_watch_streams_fails_no_predict(mesh: Mesh) -> None:
    """The issue's scenario, past the old breaker (1,024): the streams fill their own
    cluster's breaker (some are refused at once) and every Predict still answers."""
    most = mesh.spec.traffic.edge_streams.max_streams
    assert HELD_STREAMS > 1024 + most
    admin = AdminClient.of_mesh(mesh.state_dir)

    def refusals() -> tuple[int, int]:
        # (calls the streams' cluster answered 503, calls its breaker refused); Envoy counts
        # breaker refusals by the limit they hit.
        counters = admin.counters(f"cluster.{GATEWAY_STREAMS_CLUSTER}.")
        overflowed = sum(v for k, v in counters.items() if k.endswith("_overflow"))
        return counters.get(f"cluster.{GATEWAY_STREAMS_CLUSTER}.upstream_rq_503", 0), overflowed

    answered_503_before, overflowed_before = refusals()
    started = time.monotonic()
    held, refused, codes = asyncio.run(
        _hold_watches_and_predict(dial_edge(mesh.spec), HELD_STREAMS, STREAM_CHANNELS)
    )
    print(
        f"{held} Watch streams held, {refused} refused; "
        f"{codes.count(grpc.StatusCode.OK)} of {PREDICTS} Predicts OK "
        f"({time.monotonic() - started:.1f} s)"
    )
    assert codes == [grpc.StatusCode.OK] * PREDICTS, codes
    assert 0 < held <= most, held
    assert refused >= HELD_STREAMS - most, refused
    # Every refusal came from the streams' own cluster; nearly all from its breaker. The
    # rest are streams that queued behind it (max_pending_requests) and failed with a
    # connection the loaded gateway was slow to take, which Envoy counts apart.
    answered_503, overflowed = refusals()
    assert answered_503 - answered_503_before == refused
    queued = min(most, mesh.spec.traffic.edge.circuit_breakers.max_pending_requests)
    assert overflowed - overflowed_before >= refused - queued, (overflowed, refused)

    # The streams' cluster is the gateways again; the Predicts' cluster saw none of them.
    def released() -> bool:
        gauge = f"cluster.{GATEWAY_STREAMS_CLUSTER}.upstream_rq_active"
        return admin.counters(gauge).get(gauge, 1) == 0

    wait_until(released, "every held stream released by Envoy")


# --- connections -------------------------------------------------------------------------


def _listener_counter(admin: AdminClient, port: int, name: str) -> int:
    counters = admin.counters("listener.")
    return sum(v for k, v in counters.items() if f"_{port}." in k and k.endswith(name))


def test_each_listener_has_its_own_connection_cap(front_factory: FrontFactory) -> None:
    limits = ConnectionLimits(edge_max_connections=5, tls_handshake_timeout_ms=60_000)
    tight = front_factory(TrafficSpec(connections=limits))
    edge_port = tight.spec.ports.edge
    sockets = []
    try:
        for _ in range(12):
            sockets.append(socket.create_connection((tight.spec.host, edge_port), timeout=10))
        wait_until(
            lambda: _listener_counter(tight.admin, edge_port, "downstream_cx_overflow") >= 1,
            "the edge refusing connections past its own cap",
        )
        # The edge is full; a mesh listener still accepts and serves.
        zone = tight.spec.zones[0]
        assert _call(tight.mesh(zone), MODEL_INFER, (("x-servemesh-model", "fraud"),)) == (
            grpc.StatusCode.OK
        )
    finally:
        for sock in sockets:
            sock.close()


def test_a_handshake_that_never_finishes_is_closed(front_factory: FrontFactory) -> None:
    limits = ConnectionLimits(tls_handshake_timeout_ms=300)
    tight = front_factory(TrafficSpec(connections=limits))
    with socket.create_connection((tight.spec.host, tight.spec.ports.edge), timeout=20) as sock:
        started = time.monotonic()
        # Nothing sent: Envoy waits for a ClientHello, then gives up and closes.
        assert sock.recv(1) == b""
        elapsed = time.monotonic() - started
    assert elapsed < 10, elapsed


# --- rate limit per caller ---------------------------------------------------------------


@contextmanager
def relay_from(source: str, target: tuple[str, int]) -> Iterator[str]:
    """A TCP relay on 127.0.0.1 whose connections reach `target` from `source` (another
    loopback address), so Envoy sees a different client address; bytes pass unchanged
    (TLS stays end to end). Yields the relay's address; stops on exit."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    pipes: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(target, source_address=(source, 0))
            pipes.extend((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
        for sock in pipes:
            sock.close()


def test_one_flooding_caller_is_shed_and_another_still_gets_through(
    front_factory: FrontFactory,
) -> None:
    limit = RateLimit(
        requests_per_second=1000, burst=1000, per_caller_requests_per_second=2, per_caller_burst=10
    )
    tight = front_factory(TrafficSpec(rate_limit=limit))
    target = (tight.spec.host, tight.spec.ports.edge)
    edge = tight.edge
    with relay_from("127.0.0.2", target) as flooder, relay_from("127.0.0.3", target) as other:
        flood = Dial(flooder, edge.credentials, edge.options)
        calm = Dial(other, edge.credentials, edge.options)
        flooded = [_call(flood, PREDICT) for _ in range(60)]
        assert flooded.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 40, flooded
        assert set(flooded) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        # The flooder is still over its bucket; the other caller's calls all go through.
        calm_codes = [_call(calm, PREDICT) for _ in range(8)]
        assert calm_codes == [grpc.StatusCode.OK] * 8, calm_codes
        # And the flooder, flooding again, is shed again.
        again = [_call(flood, PREDICT) for _ in range(30)]
        assert again.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 10, again
