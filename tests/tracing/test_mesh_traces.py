"""Traces through a whole local mesh: a forced trace holds every hop in one tree, the
batch is linked to its request, `servemesh trace` draws it, `--slowest` orders by time,
and a request nobody asked to trace leaves nothing behind (sample ratio 0)."""

from __future__ import annotations

import secrets

import pytest

from servemesh.cli import main
from servemesh.contract.wire import Span as SpanAttr
from servemesh.identity import dial_edge
from servemesh.identity.edge_client import dial_edge_as
from servemesh.launcher import Mesh
from servemesh.tracestore.store import SpanRecord, TraceStore
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import SLOW_MS, SLOW_VERSION
from tests.waiting import wait_until

pytestmark = pytest.mark.mesh


# Every trace id a test forced: the only traces a ratio-0 mesh may record.
FORCED: set[str] = set()


def predict(mesh: Mesh, traced: bool, version: str = "") -> tuple[str, str | None]:
    """(request id, trace id or None) of one Predict through the edge."""
    trace_id = secrets.token_hex(16) if traced else None
    if trace_id:
        FORCED.add(trace_id)
    metadata = [("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01")] if traced else []
    # A pinned version at 0% answers only the operator (its certificate at the edge).
    dial = dial_edge_as(mesh.spec, mesh.spec.edge_address) if version else dial_edge(mesh.spec)
    with dial.channel() as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-7"], version=version),
            timeout=10,
            metadata=metadata,
        )
    return reply.request_id, trace_id


def complete_trace(store: TraceStore, trace_id: str) -> list[SpanRecord]:
    """The trace once every hop's spans arrived (services and Envoy export in batches)."""

    def arrived() -> list[SpanRecord] | None:
        spans = store.trace(trace_id)
        names = {(s.service, s.name) for s in spans}
        whole = {
            ("envoy-edge", "ingress"),
            ("gateway", "servemesh.gateway.v1.Gateway/Predict"),
            ("feature", "redis MGET"),
            ("model", "inference.GRPCInferenceService/ModelInfer"),
            ("model", "batch"),
        }
        meshes = [s for s in spans if s.service.startswith("envoy-mesh-")]
        # Closed: every span's parent arrived too (each process exports in batches of its
        # own, so a child may be stored before the hop that called it), but the edge's,
        # whose parent is the caller's own unstored span.
        own = [s for s in spans if s.trace_id == trace_id]
        ids = {s.span_id for s in own}
        outside = {s.parent_id for s in own if s.service == "envoy-edge"}
        closed = all(s.parent_id in ids or s.parent_id in outside for s in own)
        return spans if whole <= names and len(meshes) >= 2 and closed else None

    return wait_until(arrived, f"every hop of trace {trace_id}", timeout_s=60)


def test_a_forced_trace_holds_every_hop_in_one_tree(traced_mesh: Mesh, store: TraceStore) -> None:
    request_id, trace_id = predict(traced_mesh, traced=True)
    assert trace_id is not None
    spans = complete_trace(store, trace_id)
    own = [s for s in spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in own}

    def parent(span: SpanRecord) -> SpanRecord:
        assert span.parent_id in by_id, f"{span.name} ({span.who}) has no stored parent"
        return by_id[span.parent_id]

    edge = next(s for s in own if s.service == "envoy-edge")
    assert edge.parent_id not in by_id  # child of the caller's own (unstored) span
    predict_span = next(s for s in own if s.name.endswith("Gateway/Predict"))
    assert parent(predict_span) is edge
    assert predict_span.request_id == request_id
    assert predict_span.attributes[SpanAttr.MODEL] == "fraud"
    assert predict_span.attributes[SpanAttr.VERSION] == "v1"
    # gateway client span -> Envoy mesh -> feature server span -> Redis read
    redis = next(s for s in own if s.name == "redis MGET")
    feature = parent(redis)
    assert (feature.service, feature.name) == (
        "feature",
        "servemesh.feature.v1.FeatureService/GetFeatures",
    )
    mesh_hop = parent(feature)
    assert mesh_hop.service.startswith("envoy-mesh-")
    client = parent(mesh_hop)
    assert client.service == "gateway" and client.kind == 3  # CLIENT
    assert parent(client) is predict_span
    # gateway client span -> Envoy mesh -> model server span, which records its queue wait
    model = next(s for s in own if s.service == "model" and s.name.endswith("/ModelInfer"))
    assert parent(parent(model)).name.endswith("/ModelInfer")
    assert parent(parent(parent(model))) is predict_span
    assert model.attributes[SpanAttr.QUEUE_WAIT_MS] >= 0
    # The batch: a trace of its own, linked to the model server's request span.
    batch = next(s for s in spans if s.name == "batch")
    assert batch.trace_id != trace_id
    assert (trace_id, model.span_id) in batch.links
    assert batch.attributes[SpanAttr.BATCH_SIZE] >= 1
    assert batch.attributes[SpanAttr.FORWARD_MS] > 0
    assert batch.attributes[SpanAttr.QUEUE_WAIT_MS] >= 0
    # Every span ends inside the edge's (one request, one clock on one machine).
    assert all(edge.start_ns <= s.start_ns and s.end_ns <= edge.end_ns for s in own)


def test_servemesh_trace_draws_the_hops_in_order(
    traced_mesh: Mesh, store: TraceStore, capsys: pytest.CaptureFixture[str]
) -> None:
    request_id, trace_id = predict(traced_mesh, traced=True)
    assert trace_id is not None
    complete_trace(store, trace_id)
    capsys.readouterr()
    state = str(traced_mesh.state_dir)
    assert main(["trace", request_id, "--state-dir", state, "--width", "200"]) == 0
    drawn = capsys.readouterr().out
    assert trace_id in drawn
    lines = [line for line in drawn.splitlines() if line.startswith("│")]
    services = [line.split("│")[1].strip() for line in lines]
    first = {
        kind: next(i for i, s in enumerate(services) if s.startswith(kind))
        for kind in ("envoy-edge", "gateway-", "envoy-mesh-", "feature-", "model-")
    }
    assert first["envoy-edge"] == 0
    assert first["envoy-edge"] < first["gateway-"] < first["envoy-mesh-"] < first["feature-"]
    # Features are read before the model infers (a gateway's first call also asks a model
    # server for the signature, before both).
    infer = next(
        i
        for i, line in enumerate(lines)
        if services[i].startswith("model-") and "/ModelInfer" in line
    )
    assert first["feature-"] < infer
    assert any("↪ batch" in line for line in lines)


def test_slowest_lists_the_slow_version_first(
    traced_mesh: Mesh, store: TraceStore, capsys: pytest.CaptureFixture[str]
) -> None:
    fast = [predict(traced_mesh, traced=True) for _ in range(2)]
    slow = predict(traced_mesh, traced=True, version=SLOW_VERSION)  # SLOW_MS per batch
    for _, trace_id in [*fast, slow]:
        assert trace_id is not None
        complete_trace(store, trace_id)
    found = store.slowest(50, since_ns=0)
    durations = [s.duration_ns for s in found]
    assert durations == sorted(durations, reverse=True)
    assert found[0].request_id == slow[0] and found[0].duration_ns >= SLOW_MS * 1_000_000
    capsys.readouterr()
    state = str(traced_mesh.state_dir)
    assert (
        main(["trace", "--slowest", "3", "--since", "5m", "--state-dir", state, "--width", "200"])
        == 0
    )
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert len(listed) == 3 and slow[0] in listed[0]


def test_hops_sum_where_the_last_traces_spent_their_time(
    traced_mesh: Mesh, store: TraceStore, capsys: pytest.CaptureFixture[str]
) -> None:
    traced = [predict(traced_mesh, traced=True) for _ in range(3)]
    for _, trace_id in traced:
        assert trace_id is not None
        complete_trace(store, trace_id)
    capsys.readouterr()
    state = str(traced_mesh.state_dir)
    argv = ["trace", "--hops", "3", "--since", "5m", "--state-dir", state, "--width", "250"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "3 rooted at envoy-edge ingress" in printed
    rows = {
        cells[1].strip(): cells[2:]
        for line in printed.splitlines()
        if line.startswith("│") and len(cells := line.split("│")) > 6
    }
    # Every Predict went edge -> gateway -> a zone's Envoy -> the feature and model servers.
    first = rows["envoy-edge ingress → gateway Gateway/Predict starts"]
    assert int(first[0]) == 3 and float(first[1]) > 0
    assert any(label.startswith("envoy-mesh-zone-") and "→ model" in label for label in rows)
    assert "inside feature redis MGET" in rows


def test_an_unsampled_request_records_nothing(traced_mesh: Mesh, store: TraceStore) -> None:
    quiet = [predict(traced_mesh, traced=False)[0] for _ in range(5)]
    # Spans leave each process in order: once a later forced trace is whole, anything the
    # quiet requests had recorded would have arrived before it.
    _, trace_id = predict(traced_mesh, traced=True)
    assert trace_id is not None
    complete_trace(store, trace_id)
    assert [store.find(request_id) for request_id in quiet] == [None] * 5
    # Nor did anything else (health probes, Envoy's own checks) start a trace of its own.
    roots = {s.trace_id for s in store.slowest(10_000, since_ns=0)}
    assert trace_id in roots and roots <= FORCED
