"""A caller cannot flood the trace store by forcing sampling at the edge.

A sampled `traceparent` forces a trace through every hop (the tracers are parent-based),
and Envoy decides before any filter runs. The edge holds such calls to a budget of their
own (tracing.forced_traces_*): one caller flooding forced traces gets RESOURCE_EXHAUSTED
past its bucket and the trace store holds no more of its traces than the budget allows,
while another caller's calls (with or without a traceparent) and the flooder's own
unsampled ones go through. Each caller is its own loopback source address, through a
relay (tests/mesh/test_edge_limits.py), so Envoy keeps a bucket for each.
"""

from __future__ import annotations

import secrets
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from servemesh.contract.wire import GATEWAY_SERVICE, HEALTH_SERVICE, method_path
from servemesh.identity import Dial, dial_edge
from servemesh.launcher import Mesh
from servemesh.proxy.admin import AdminClient
from servemesh.tracestore.store import TraceStore
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.test_edge_limits import relay_from
from tests.waiting import wait_until

pytestmark = pytest.mark.mesh

FLOOD = 200
PREDICT_SPAN = ("gateway", f"{GATEWAY_SERVICE}/Predict")


def _traceparent(flags: str = "01") -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return f"00-{trace_id}-{secrets.token_hex(8)}-{flags}", trace_id


def _predict(
    stub: gateway_pb2_grpc.GatewayStub, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    try:
        stub.Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-7"]),
            timeout=10,
            metadata=metadata,
        )
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
def edge_target(traced_mesh: Mesh) -> tuple[str, int]:
    return traced_mesh.spec.host, traced_mesh.spec.ports.edge


def _via(relay: str, mesh: Mesh) -> Dial:
    edge = dial_edge(mesh.spec)
    return Dial(relay, edge.credentials, edge.options)


def test_one_caller_forcing_every_trace_is_held_to_the_budget(
    traced_mesh: Mesh, store: TraceStore, edge_target: tuple[str, int]
) -> None:
    tracing = traced_mesh.spec.tracing
    rate = min(tracing.forced_traces_per_caller_per_second, tracing.forced_traces_per_second)
    burst = min(tracing.forced_traces_per_caller_burst, tracing.forced_traces_burst)
    flood_ids: dict[str, grpc.StatusCode] = {}
    other: list[tuple[str, grpc.StatusCode]] = []
    other_forced: list[str] = []
    flooding = threading.Event()

    def calm_caller(dial: Dial) -> None:
        """Another caller, meanwhile: plain calls, unsampled ones and a few forced ones
        (its own bucket) all go through."""
        with dial.channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            flooding.wait(timeout=30)
            for i in range(60):
                if i % 20 == 0:  # a forced trace now and then: 3 in all, within its bucket
                    traceparent, trace_id = _traceparent()
                    other_forced.append(trace_id)
                    other.append(("forced", _predict(stub, (("traceparent", traceparent),))))
                elif i % 2:
                    other.append(("plain", _predict(stub)))
                else:
                    unsampled = (("traceparent", _traceparent("00")[0]),)
                    other.append(("unsampled", _predict(stub, unsampled)))

    with (
        relay_from("127.0.0.2", edge_target) as flooder,
        relay_from("127.0.0.3", edge_target) as calm,
    ):
        thread = threading.Thread(target=calm_caller, args=(_via(calm, traced_mesh),))
        thread.start()
        with _via(flooder, traced_mesh).channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            grpc.channel_ready_future(channel).result(timeout=10)
            started = time.monotonic()
            flooding.set()
            for _ in range(FLOOD):
                traceparent, trace_id = _traceparent()
                flood_ids[trace_id] = _predict(stub, (("traceparent", traceparent),))
            elapsed = time.monotonic() - started
            # The flooder's bucket is empty now; its unsampled calls never touch it.
            unsampled = [
                _predict(stub, (("traceparent", _traceparent("00")[0]),)) for _ in range(20)
            ]
            plain = [_predict(stub) for _ in range(20)]
        thread.join(timeout=120)
    assert not thread.is_alive()

    codes = list(flood_ids.values())
    admitted = {t for t, code in flood_ids.items() if code == grpc.StatusCode.OK}
    # The per-caller bucket: its burst, then `rate` a second (filled once a second, so one
    # fill more than the whole seconds elapsed).
    bound = burst + rate * (int(elapsed) + 1)
    print(
        f"{FLOOD} forced traces in {elapsed:.2f} s: {len(admitted)} admitted "
        f"(bound {bound}), {codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)} shed"
    )
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, set(codes)
    assert burst <= len(admitted) <= bound, (len(admitted), bound)
    assert unsampled == [grpc.StatusCode.OK] * 20, unsampled
    assert plain == [grpc.StatusCode.OK] * 20, plain
    assert [code for _, code in other] == [grpc.StatusCode.OK] * 60, other

    # Every admitted trace reaches the store whole enough to show its Predict...
    def arrived() -> bool:
        return all(
            PREDICT_SPAN in {(s.service, s.name) for s in store.trace(t)}
            for t in [*admitted, *other_forced]
        )

    wait_until(arrived, "the admitted forced traces in the store", timeout_s=60)
    # ... and a shed one never reached a service: at most the edge's own span, which
    # Envoy records before any filter runs (one span, no hop past the edge).
    beyond_edge = {t for t in flood_ids if any(s.service != "envoy-edge" for s in store.trace(t))}
    assert beyond_edge == admitted
    edge_only = [t for t in flood_ids if t not in admitted and store.trace(t)]
    spans = sum(len(store.trace(t)) for t in flood_ids)
    print(
        f"store: {len(beyond_edge)} flood traces past the edge, {len(edge_only)} shed calls "
        f"with an edge span only; {spans} flood spans in all"
    )
    assert all(len(store.trace(t)) <= 1 for t in edge_only)
    # Operators see the budget at work in Envoy's counters.
    counters = AdminClient.of_mesh(traced_mesh.state_dir).counters("")
    limited = {k: v for k, v in counters.items() if "edge_forced_traces" in k}
    print(limited)
    assert sum(v for k, v in limited.items() if k.endswith(".rate_limited")) >= len(edge_only)


_WATCH = method_path(HEALTH_SERVICE, "Watch")
_CHECK = method_path(HEALTH_SERVICE, "Check")


def _health(
    channel: grpc.Channel, path: str, metadata: tuple[tuple[str, str], ...]
) -> grpc.StatusCode:
    request = health_pb2.HealthCheckRequest().SerializeToString()
    try:
        if path == _WATCH:
            stream = channel.unary_stream(path)(request, metadata=metadata, timeout=10)
            next(stream)
            stream.cancel()
        else:
            channel.unary_unary(path)(request, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("source", "what", "forces"),
    [
        ("127.0.0.4", "upper-case hex", True),
        ("127.0.0.5", "an unknown version", True),
        ("127.0.0.6", "health Check", True),
        ("127.0.0.7", "health Watch", True),
        ("127.0.0.8", "flags 02 (not sampled)", False),
        # Which of two traceparents Envoy's tracer reads is Envoy's (and the client's) call:
        # whichever it is, the budget follows it.
        ("127.0.0.9", "two headers, sampled then unsampled", None),
        ("127.0.0.10", "two headers, unsampled then sampled", None),
    ],
)
def test_every_spelling_and_method_that_forces_a_trace_is_budgeted(
    traced_mesh: Mesh,
    store: TraceStore,
    edge_target: tuple[str, int],
    source: str,
    what: str,
    forces: bool | None,
) -> None:
    """A call is held to the budget exactly when Envoy's tracer reads its traceparent as
    sampled (it then records the edge's span, at ratio 0 nothing else does), whatever the
    spelling or method."""
    calls = 30
    sent: list[set[str]] = []

    def metadata() -> tuple[tuple[str, str], ...]:
        tid, sid = secrets.token_hex(16), secrets.token_hex(8)
        other, other_id = _traceparent("00" if what.endswith("then unsampled") else "01")
        sent.append({tid, other_id})
        if what == "upper-case hex":
            return (("traceparent", f"00-{tid.upper()}-{sid.upper()}-0B"),)
        if what == "an unknown version":
            return (("traceparent", f"7f-{tid}-{sid}-01"),)
        if what == "flags 02 (not sampled)":
            return (("traceparent", f"00-{tid}-{sid}-02"),)
        if what == "two headers, sampled then unsampled":
            return (("traceparent", f"00-{tid}-{sid}-01"), ("traceparent", other))
        if what == "two headers, unsampled then sampled":
            return (("traceparent", f"00-{tid}-{sid}-00"), ("traceparent", other))
        return (("traceparent", f"00-{tid}-{sid}-01"),)

    with relay_from(source, edge_target) as relay, _via(relay, traced_mesh).channel() as channel:
        if what.startswith("health"):
            path = _WATCH if what.endswith("Watch") else _CHECK
            codes = [_health(channel, path, metadata()) for _ in range(calls)]
        else:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            codes = [_predict(stub, metadata()) for _ in range(calls)]
        # A forced trace after them: once its edge span is stored, theirs would be too.
        marker, marker_id = _traceparent()
        assert _predict(gateway_pb2_grpc.GatewayStub(channel), (("traceparent", marker),)) in {
            grpc.StatusCode.OK,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        }
    wait_until(lambda: store.trace(marker_id), "the marker's edge span in the store")

    def recorded() -> list[bool]:
        return [any(store.trace(t) for t in ids) for ids in sent]

    traced = recorded()
    if any(traced):  # Envoy's workers export apart: wait for every edge span
        wait_until(lambda: all(recorded()), f"every edge span of {what}")
        traced = recorded()
    shed = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    print(f"{what}: {sum(traced)} of {calls} traced by Envoy, {shed} shed")
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, set(codes)
    if forces is not None:
        assert all(traced) if forces else not any(traced), traced
    # Traced by Envoy: past the per-caller burst, shed. Not traced: never shed.
    assert all(traced) or not any(traced), traced
    assert (shed > 0) == all(traced), (shed, traced)
