"""`servemesh bench observe` without a mesh: the meshes it compares, its verdicts from the
rounds it measured, what a whole trace is; and the two settings the budgets rest on (an
unsampled caller's trace records nothing, Envoy flushes as often as the services)."""

from __future__ import annotations

import math

from servemesh.bench.observe import (
    LOG_ONLY,
    OBSERVED,
    OFF,
    TRACING_ONLY,
    Probe,
    Report,
    Round,
    arm_specs,
    is_whole,
)
from servemesh.proxy.tracing import tracer_runtime
from servemesh.services.runtime.tracing import _UNSAMPLED
from servemesh.spec import MeshSpec, Ports, resolve
from servemesh.tracestore.store import SpanRecord


def test_the_meshes_differ_only_in_tracing_and_the_log() -> None:
    spec = MeshSpec()
    arms = arm_specs(spec, split=True)
    assert set(arms) == {OBSERVED, OFF, TRACING_ONLY, LOG_ONLY}
    switches = {
        name: (arm.tracing.enabled, arm.prediction_log.enabled) for name, arm in arms.items()
    }
    assert switches == {
        OBSERVED: (True, True),
        OFF: (False, False),
        TRACING_ONLY: (True, False),
        LOG_ONLY: (False, True),
    }
    for arm in arms.values():
        assert arm.ports.edge == 0 and arm.metrics.prometheus == "off"
        assert arm.tracing.sample_ratio == spec.tracing.sample_ratio
        assert arm.models == spec.models and arm.gateway == spec.gateway
    assert set(arm_specs(spec)) == {OBSERVED, OFF}


def _round(arm: str, repeat: int, rps: float) -> Round:
    return Round(arm, repeat, rps, 10.0, 20.0, 0, {"gateway": 1.0})


def _report(observed: list[float], off: list[float], whole_s: list[float]) -> Report:
    report = Report("2026-11-30", 64, 4.0, len(off), 0.01, 1000, arms=[OBSERVED, OFF])
    for repeat, (a, b) in enumerate(zip(observed, off, strict=True)):
        report.rounds += [_round(OBSERVED, repeat, a), _round(OFF, repeat, b)]
    report.probes["idle"] = [Probe(0.5, w) for w in whole_s]
    return report


def test_the_throughput_verdict_takes_the_worse_of_two_readings() -> None:
    # Medians 95 against 100, but the repeats' own ratios say 0.85: the budget is missed.
    summary = _report([95, 85, 96], [100, 100, 113], [0.9]).summary()
    assert summary["ratio_of_medians"] == 0.95
    assert summary["ratio_median_of_repeats"] == 0.85
    assert summary["throughput_cost"] == 0.15 and summary["throughput_budget_met"] is False

    summary = _report([95, 92, 100], [100, 100, 105], [0.9]).summary()
    assert summary["throughput_cost"] == 0.05 and summary["throughput_budget_met"] is True


def test_the_freshness_verdict_needs_every_probe_whole_within_two_seconds() -> None:
    assert _report([1], [1], [0.9, 1.9]).summary()["freshness_budget_met"]
    assert not _report([1], [1], [0.9, 2.1]).summary()["freshness_budget_met"]
    # A probe whose trace never became whole (NaN) misses the budget.
    assert not _report([1], [1], [0.9, math.nan]).summary()["freshness_budget_met"]


def _span(service: str, name: str) -> SpanRecord:
    return SpanRecord("t" * 32, name + service, None, name, service, 0, 1)


def test_a_whole_trace_holds_every_hop() -> None:
    spans = [
        _span("envoy-edge", "ingress"),
        _span("gateway", "servemesh.gateway.v1.Gateway/Predict"),
        _span("envoy-mesh-zone-a", "ingress"),
        _span("feature", "redis MGET"),
        _span("envoy-mesh-zone-a", "ingress2"),
        _span("model", "inference.GRPCInferenceService/ModelInfer"),
        _span("model", "batch"),
    ]
    assert is_whole(spans)
    assert not is_whole([s for s in spans if s.name != "batch"])
    assert not is_whole([s for s in spans if s.name != "ingress2"])  # one mesh hop missing


def test_only_a_well_formed_unsampled_traceparent_skips_the_spans() -> None:
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    assert _UNSAMPLED.match(f"00-{trace_id}-{span_id}-00")
    assert _UNSAMPLED.match(f"00-{trace_id}-{span_id}-02")  # other flags, not sampled
    assert not _UNSAMPLED.match(f"00-{trace_id}-{span_id}-01")  # sampled
    assert not _UNSAMPLED.match(f"00-{trace_id}-{span_id}-03")
    assert not _UNSAMPLED.match(f"00-{'0' * 32}-{span_id}-00")  # invalid trace id
    assert not _UNSAMPLED.match(f"00-{trace_id}-{'0' * 16}-00")  # invalid span id
    assert not _UNSAMPLED.match(f"00-{trace_id.upper()}-{span_id}-00")
    assert not _UNSAMPLED.match(f"00-{trace_id}-{span_id}-00-extra")


def test_envoy_flushes_its_spans_as_often_as_the_services() -> None:
    ports = Ports.free()
    spec = MeshSpec(ports=ports)
    spec = spec.model_copy(
        update={"tracing": spec.tracing.model_copy(update={"export_interval_ms": 250})}
    )
    assert tracer_runtime(resolve(spec)) == {"tracing.opentelemetry.flush_interval_ms": 250}
    off = spec.model_copy(update={"tracing": spec.tracing.model_copy(update={"enabled": False})})
    assert tracer_runtime(resolve(off)) == {}
