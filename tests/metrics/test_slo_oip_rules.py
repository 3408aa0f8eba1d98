"""An SLO counts every caller's calls: OIP ModelInfer at the edge (REST or gRPC) spends a
model's error budget as Predict does, in Prometheus's own rule engine (`promtool test
rules`) and in the counts the rollout gate reads from the gateways when Prometheus is not
there."""

from __future__ import annotations

from pathlib import Path

import pytest

from servemesh.observe.scrape import parse
from servemesh.rollout.budget import count_from_samples
from servemesh.slo_rules import (
    BURN_RATE,
    OIP_INFERS,
    OIP_SECONDS,
    PREDICT,
    PREDICT_SECONDS,
    SLO_ALERTS,
    SLO_RUNBOOK,
)
from servemesh.spec import MeshSpec
from servemesh.spec.rollout_plan import RolloutSpec, SloSpec
from tests.metrics.promtool_rules import NO_PROMTOOL, PROMTOOL, run_rule_tests, series

PER_MINUTE = "0+60x90"  # 60 calls a minute for an hour and a half


def _predict_ok(model: str) -> list[dict[str, str]]:
    labels = {"model": model, "version": "v1", "route": "routed"}
    return [
        series(PREDICT, PER_MINUTE, code="OK", degraded="false", **labels),
        series(f"{PREDICT_SECONDS}_bucket", PER_MINUTE, le="0.1", **labels),
        series(f"{PREDICT_SECONDS}_bucket", PER_MINUTE, le="+Inf", **labels),
        series(f"{PREDICT_SECONDS}_count", PER_MINUTE, **labels),
    ]


def _oip(model: str, code: str) -> list[dict[str, str]]:
    labels = {"model": model, "version": "v1", "route": "routed", "method": "ModelInfer"}
    return [
        series(OIP_INFERS, PER_MINUTE, code=code, **labels),
        series(f"{OIP_SECONDS}_bucket", PER_MINUTE, le="0.1", **labels),
        series(f"{OIP_SECONDS}_bucket", PER_MINUTE, le="+Inf", **labels),
        series(f"{OIP_SECONDS}_count", PER_MINUTE, **labels),
    ]


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_failing_oip_calls_burn_the_budget_that_predict_alone_would_leave_whole(
    tmp_path: Path,
) -> None:
    # fraud: every Predict answers, every OIP ModelInfer fails INTERNAL: half its calls
    # failed, a burn of 50x a 99% objective. wine: the same Predicts, its OIP calls answer.
    slo = SloSpec(availability=0.99, p99_ms=100, window="30d")
    spec = MeshSpec(rollout=RolloutSpec(slos={"fraud": slo, "wine": slo}))
    burning = f'{BURN_RATE}{{objective="availability",window="300s",model="%s"}} > 40'
    paged = {
        "exp_labels": {
            "severity": "page",
            "model": "fraud",
            "objective": "availability",
            "window": "3600s",
        },
        # Half of fraud's calls failed: a burn of 50x the 1% allowed.
        "exp_annotations": {
            "description": "availability objective of fraud's SLO (availability 0.99 over "
            "30d); burn rate now 50.0",
            "runbook": SLO_RUNBOOK,
            "summary": "fraud: availability budget burning over 14.4x over 3600s and 300s",
        },
    }
    tests = [
        {
            "interval": "1m",
            "input_series": [
                *_predict_ok("fraud"),
                *_oip("fraud", "INTERNAL"),
                *_predict_ok("wine"),
                *_oip("wine", "OK"),
            ],
            "promql_expr_test": [
                {
                    "expr": f"count({burning % 'fraud'})",
                    "eval_time": "70m",
                    "exp_samples": [{"labels": "{}", "value": 1}],
                },
                {
                    "expr": f"count({burning % 'wine'}) or vector(0)",
                    "eval_time": "70m",
                    "exp_samples": [{"labels": "{}", "value": 0}],
                },
            ],
            "alert_rule_test": [
                {"eval_time": "70m", "alertname": SLO_ALERTS["fast"], "exp_alerts": [paged]},
            ],
        }
    ]
    done = run_rule_tests(tmp_path, spec, tests)
    assert done.returncode == 0, done.stdout + done.stderr


GATEWAY_TEXT = f"""
# TYPE servemesh_gateway_predictions counter
{PREDICT}{{model="fraud",version="v1",degraded="false",code="OK",route="routed"}} 900
{PREDICT}{{model="fraud",version="fallback",degraded="true",code="OK",route="routed"}} 4
# TYPE servemesh_gateway_oip_infers counter
{OIP_INFERS}{{model="fraud",version="v1",code="OK",route="routed",method="ModelInfer"}} 80
{OIP_INFERS}{{model="fraud",version="v2",code="UNAVAILABLE",route="pinned",method="ModelInfer"}} 16
{OIP_INFERS}{{model="wine",version="v1",code="INTERNAL",route="routed",method="ModelInfer"}} 50
# TYPE servemesh_gateway_predict_duration_seconds histogram
{PREDICT_SECONDS}_bucket{{model="fraud",version="v1",route="routed",le="0.1"}} 900
{PREDICT_SECONDS}_bucket{{model="fraud",version="v1",route="routed",le="+Inf"}} 904
{PREDICT_SECONDS}_count{{model="fraud",version="v1",route="routed"}} 904
# TYPE servemesh_gateway_oip_infer_duration_seconds histogram
{OIP_SECONDS}_bucket{{model="fraud",version="v1",route="routed",method="ModelInfer",le="0.1"}} 90
{OIP_SECONDS}_bucket{{model="fraud",version="v1",route="routed",method="ModelInfer",le="+Inf"}} 96
{OIP_SECONDS}_count{{model="fraud",version="v1",route="routed",method="ModelInfer"}} 96
"""


def test_the_gateways_counts_add_oip_calls_as_the_rules_do() -> None:
    slo = SloSpec(availability=0.99, p99_ms=100)
    availability, latency = count_from_samples(parse(GATEWAY_TEXT), "fraud", slo)
    # 904 Predicts (4 degraded) and 96 OIP calls (16 failed); wine's are not fraud's.
    assert (availability.total, availability.bad) == (1000, 20)
    # Above 100 ms: 4 Predicts and 6 OIP calls of 1,000.
    assert (latency.total, latency.bad) == (1000, 10)
