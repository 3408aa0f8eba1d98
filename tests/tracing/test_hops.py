"""`servemesh trace --hops`: a trace cut into the stretches between its span boundaries,
and those stretches summed over many traces, on hand-built spans."""

from __future__ import annotations

import pytest
from rich.console import Console

from servemesh.tracestore.hops import hops_tables, summarize_hops, trace_hops
from servemesh.tracestore.store import SpanRecord
from tests.tracing.test_store import request_trace, span

PREDICT = "servemesh.gateway.v1.Gateway/Predict"
MODEL_CALL = "gateway GRPCInferenceService/ModelInfer"
BETWEEN = f"between gateway FeatureService/GetFeatures and {MODEL_CALL}"


def predict_trace(trace: str, into_gateway_ms: float) -> list[SpanRecord]:
    """edge (0-10 ms) -> gateway (from `into_gateway_ms` to 9) -> a feature read (2-4) and a
    model call (5-8), each through its zone's Envoy; the model's batch linked in."""
    return [
        span(trace, "1", "f", "ingress", 0, 10, service="envoy-edge"),
        span(
            trace,
            "2",
            "1",
            "servemesh.gateway.v1.Gateway/Predict",
            into_gateway_ms,
            9 - into_gateway_ms,
        ),
        span(trace, "3", "2", "servemesh.feature.v1.FeatureService/GetFeatures", 2, 2),
        span(trace, "4", "3", "ingress", 2.5, 1.5, service="envoy-mesh-zone-a"),
        span(trace, "5", "2", "inference.GRPCInferenceService/ModelInfer", 5, 3),
        *request_trace(chr(ord(trace) + 1), 10, "other")[3:],  # a batch of another trace
    ]


def test_a_trace_is_cut_into_hops_that_add_up_to_its_root() -> None:
    hops = trace_hops(predict_trace("a", 1.0))
    assert [(h.label, round(h.ms, 3)) for h in hops] == [
        ("envoy-edge ingress → gateway Gateway/Predict starts", 1.0),
        ("gateway Gateway/Predict → gateway FeatureService/GetFeatures starts", 1.0),
        ("gateway FeatureService/GetFeatures → envoy-mesh-zone-a ingress starts", 0.5),
        ("inside envoy-mesh-zone-a ingress", 1.5),
        ("envoy-mesh-zone-a ingress ends → gateway FeatureService/GetFeatures ends", 0.0),
        (BETWEEN, 1.0),
        ("inside gateway GRPCInferenceService/ModelInfer", 3.0),
        ("gateway GRPCInferenceService/ModelInfer ends → gateway Gateway/Predict ends", 1.0),
        ("gateway Gateway/Predict ends → envoy-edge ingress ends", 1.0),
    ]
    assert sum(h.ms for h in hops) == pytest.approx(10.0)


def test_overlapping_children_count_once_and_the_hops_still_add_up_to_the_root() -> None:
    spans = [
        span("a", "1", "f", "ingress", 0, 10, service="envoy-edge"),
        span("a", "2", "1", "try", 1, 6),
        span("a", "3", "1", "hedge", 3, 6),  # starts before the first try ends
        span("a", "4", "3", "inner", 4, 1),  # not cut further: its parent overlaps
    ]
    hops = trace_hops(spans)
    assert [(h.label, round(h.ms, 3)) for h in hops] == [
        ("envoy-edge ingress → gateway try starts", 1.0),
        ("inside gateway try", 6.0),
        ("inside gateway hedge (overlapping)", 2.0),
        ("gateway hedge ends → envoy-edge ingress ends", 1.0),
    ]
    assert sum(h.ms for h in hops) == pytest.approx(10.0)
    # A child that outlives its parent (a copy sent on) counts up to the parent's end.
    outliving = [
        span("c", "1", "f", "ingress", 0, 10, service="envoy-edge"),
        span("c", "2", "1", "copy", 5, 20),
    ]
    hops = trace_hops(outliving)
    assert [(h.label, round(h.ms, 3)) for h in hops] == [
        ("envoy-edge ingress → gateway copy starts", 5.0),
        ("inside gateway copy (overlapping)", 5.0),
        ("gateway copy ends → envoy-edge ingress ends", 0.0),
    ]


def test_a_hop_met_twice_in_one_trace_counts_once_per_trace() -> None:
    spans = [
        span("a", "1", "f", "ingress", 0, 10, service="envoy-edge"),
        span("a", "2", "1", "try", 1, 2),
        span("a", "3", "1", "try", 4, 2),  # the retry: the same labels again
    ]
    rows, total = summarize_hops([spans])
    assert total == 10.0
    inside = next(r for r in rows if r.label == "inside gateway try")
    assert (inside.traces, inside.median_ms) == (1, 4.0)


def test_hops_over_many_traces_give_each_its_median_p90_and_share() -> None:
    traces = [predict_trace(t, into) for t, into in (("a", 1.0), ("c", 2.0), ("e", 3.0))]
    rows, total = summarize_hops(traces)
    assert total == 10.0
    first = rows[0]
    assert first.label == "envoy-edge ingress → gateway Gateway/Predict starts"
    assert (first.traces, first.median_ms, first.p90_ms, first.max_ms) == (3, 2.0, 3.0, 3.0)
    ten = summarize_hops([predict_trace("a", float(i) / 10) for i in range(1, 11)])[0][0]
    assert ten.p90_ms == 0.9  # the 9th of 10, not the largest
    assert first.share == 0.2
    # Health checks and Predicts are told apart: one table per kind of root.
    health = [span("g", "1", None, "grpc.health.v1.Health/Check", 0, 0.1, service="model")]
    console = Console(width=200, record=True)
    for table in hops_tables([*traces, health], "the last 4 traces"):
        console.print(table)
    text = console.export_text()
    assert "3 rooted at envoy-edge ingress, the median 10.00 ms" in text
    assert "1 rooted at model Health/Check, the median 0.10 ms" in text
    assert text.index("envoy-edge ingress, the median") < text.index("model Health/Check, the")
