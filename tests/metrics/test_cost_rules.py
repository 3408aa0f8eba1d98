"""The cost rules, evaluated by Prometheus's own rule engine (`promtool test rules`) on
series written here: each model's CPU (model servers by compute share, gateways and
feature services by Predict share), its cost per hour and per million predictions, and
the alert when a million predictions cost more than a week before."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from servemesh.slo_rules import COST_ALERT, COST_PER_HOUR, COST_PER_MILLION
from servemesh.spec import CostSpec, MeshSpec
from tests.metrics.promtool_rules import NO_PROMTOOL, PROMTOOL, run_rule_tests, series

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
PRICES = CostSpec(per_core_hour=0.04, per_gpu_hour=2.5, alert_weekly_rise=0.25)


def counter(per_step: float, steps: int, start: float = 0.0) -> str:
    """promtool's expanding notation: `start`, then `per_step` more each interval."""
    return f"{start:g}+{per_step:g}x{steps}"


def run_tests(
    tmp_path: Path, tests: list[dict[str, Any]], evaluation_interval: str = "1m"
) -> subprocess.CompletedProcess[str]:
    return run_rule_tests(tmp_path, MeshSpec(cost=PRICES), tests, evaluation_interval)


def test_each_model_is_given_its_share_of_the_cpu_and_priced(tmp_path: Path) -> None:
    n = 150  # minutes of series
    inputs = [
        # model servers: 0.8 cores, their compute 3:1 between a and b
        series("process_cpu_seconds_total", counter(48, n), job="servemesh", service="model",
               instance="model-fraud-zone-a-0"),
        series("servemesh_model_compute_seconds_sum", counter(30, n), model="a", version="v1",
               instance="model-fraud-zone-a-0"),
        series("servemesh_model_compute_seconds_sum", counter(10, n), model="b", version="v1",
               instance="model-fraud-zone-a-0"),
        # gateways and feature services: 0.4 cores, Predicts 1:3 between a and b
        series("process_cpu_seconds_total", counter(12, n), job="servemesh", service="gateway",
               instance="gateway-zone-a-0"),
        series("process_cpu_seconds_total", counter(12, n), job="servemesh", service="feature",
               instance="feature-zone-a-0"),
        series("servemesh_gateway_predictions_total", counter(6000, n), model="a", code="OK",
               version="v1", zone="zone-a"),
        series("servemesh_gateway_predictions_total", counter(18000, n), model="b", code="OK",
               version="v1", zone="zone-a"),
        # a failed Predict is no prediction: not counted in the share or the million
        series("servemesh_gateway_predictions_total", counter(600, n), model="b",
               code="UNAVAILABLE", version="v1", zone="zone-a"),
        # b's model server holds a GPU
        series("servemesh_model_on_gpu", f"1x{n}", model="b", version="v1",
               instance="model-fraud-zone-a-0"),
    ]  # fmt: skip
    cores = {"a": 0.8 * 0.75 + 0.4 * 0.25, "b": 0.8 * 0.25 + 0.4 * 0.75}
    per_hour = {"a": cores["a"] * 0.04, "b": cores["b"] * 0.04 + 2.5}
    per_s = {"a": 100.0, "b": 300.0}
    per_million = {m: per_hour[m] / (per_s[m] * 3600) * 1e6 for m in per_hour}
    # promtool compares exactly: the figures are compared in units of 1e-9, rounded.
    checks = [
        {
            "expr": f"round({record} * 1e9)",
            "eval_time": "2h",
            "exp_samples": [
                {"labels": f'{{model="{m}"}}', "value": round(want[m] * 1e9)} for m in ("a", "b")
            ],
        }
        for record, want in (
            ("servemesh:model_cpu_cores:rate1h", cores),
            (COST_PER_HOUR, per_hour),
            (COST_PER_MILLION, per_million),
        )
    ]
    done = run_tests(
        tmp_path, [{"interval": "1m", "input_series": inputs, "promql_expr_test": checks}]
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_million_predictions_costing_more_than_a_week_before_alerts(tmp_path: Path) -> None:
    # 30-minute samples over 9 days; from day 8 the model servers burn twice the CPU for
    # the same Predicts (a slower build, say): the cost per million doubles.
    week = 7 * 48
    steady, hotter = 8 * 48, 48
    cpu = f"{counter(900, steady)} {counter(1800, hotter, start=900 * steady + 1800)}"
    inputs = [
        series("process_cpu_seconds_total", cpu, job="servemesh", service="model",
               instance="model-fraud-zone-a-0"),
        series("servemesh_model_compute_seconds_sum", counter(600, steady + hotter + 1),
               model="a", version="v1", instance="model-fraud-zone-a-0"),
        series("servemesh_gateway_predictions_total", counter(90000, steady + hotter + 1),
               model="a", code="OK", version="v1", zone="zone-a"),
    ]  # fmt: skip
    alert = {
        "eval_time": f"{(steady + 6) * 30}m",  # three hours into the hotter day
        "alertname": COST_ALERT,
        "exp_alerts": [
            {
                "exp_labels": {"model": "a", "severity": "ticket"},
                "exp_annotations": {
                    "summary": "a: a million predictions cost more than 25% above the same "
                    "hour last week"
                },
            }
        ],
    }
    quiet = {"eval_time": f"{(week + 48) * 30}m", "alertname": COST_ALERT, "exp_alerts": []}
    done = run_tests(
        tmp_path,
        [{"interval": "30m", "input_series": inputs, "alert_rule_test": [quiet, alert]}],
        evaluation_interval="30m",  # nine days of rules at every minute is slow
    )
    assert done.returncode == 0, done.stdout + done.stderr
