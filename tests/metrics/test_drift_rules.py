"""The drift alert, evaluated by Prometheus's own rule engine (`promtool test rules`) on
series written here, and the registry's drift gauges it reads: a feature that drifts (a
large PSI, a small p-value, enough values) for `alert_after` tickets, naming its runbook; a
large PSI on few values or without a small p-value does not."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from servemesh.observe.scrape import parse
from servemesh.predlog.drift import DriftReport, FeatureDrift, Reference
from servemesh.registry.drift import DriftMetrics
from servemesh.slo_rules import DRIFT_ALERT, DRIFT_RUNBOOK
from servemesh.spec import MeshSpec
from tests.metrics.promtool_rules import (
    NO_PROMTOOL,
    PROMTOOL,
    rules_file,
    run_rule_tests,
    series,
)

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)


def _series(name: str, value: float, minutes: int, **labels: str) -> dict[str, str]:
    return series(name, f"{value:g}x{minutes}", **labels)


def _feature(feature: str, psi: float, p_value: float, rows: int) -> list[dict[str, str]]:
    labels = {"model": "fraud", "version": "*", "feature": feature}
    return [
        _series("servemesh_feature_drift_psi", psi, 40, **labels),
        _series("servemesh_feature_drift_p_value", p_value, 40, **labels),
        _series("servemesh_feature_drift_rows", rows, 40, **labels),
    ]


@needs_promtool
def test_a_drifting_feature_tickets_after_alert_after_and_others_never(tmp_path: Path) -> None:
    inputs = [
        *_feature("f00", 0.9, 1e-40, 5000),  # drifting
        *_feature("f01", 0.02, 0.6, 5000),  # steady
        *_feature("f02", 1.5, 1e-9, 50),  # moved, on too few values to say
        *_feature("f03", 0.4, 0.2, 5000),  # large PSI, but a sample that may be noise
    ]
    fired: dict[str, Any] = {
        "exp_labels": {"severity": "ticket", "model": "fraud", "version": "*", "feature": "f00"},
        "exp_annotations": {
            "summary": "fraud: feature f00 drifted from its reference",
            "description": "PSI 0.90 over the last 1h of fraud's calls (version *; * is every "
            "version against the model's reference); `servemesh drift fraud` shows every feature",
            "runbook": DRIFT_RUNBOOK,
        },
    }
    tests = [
        {
            "interval": "1m",
            "input_series": inputs,
            "alert_rule_test": [
                # alert_after (15m) not yet held
                {"eval_time": "10m", "alertname": DRIFT_ALERT, "exp_alerts": []},
                {"eval_time": "20m", "alertname": DRIFT_ALERT, "exp_alerts": [fired]},
            ],
        }
    ]
    done = run_rule_tests(tmp_path, MeshSpec(), tests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert PROMTOOL is not None
    checked = subprocess.run(
        [PROMTOOL, "check", "rules", str(rules_file(tmp_path, MeshSpec()))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _report(version: str | None, *features: FeatureDrift) -> DriftReport:
    reference = Reference(model="fraud", version=version, source="t.parquet", created="", rows=1)
    return DriftReport("fraud", version, 3600.0, reference, 10, 10, 10, list(features))


def _gauges(metrics: DriftMetrics) -> dict[tuple[str, str, str, str], float]:
    found = {}
    for sample in parse(generate_latest(metrics.registry).decode()):
        if sample.name.startswith("servemesh_feature_drift_") and "feature" in sample.labels:
            key = (sample.name, sample.labels["version"], sample.labels["feature"])
            found[(*key, sample.labels["model"])] = sample.value
    return found


def test_the_gauges_follow_each_round_and_drop_what_is_no_longer_compared() -> None:
    metrics = DriftMetrics()
    metrics.publish(
        [
            _report(
                None,
                FeatureDrift("f00", "numeric", 900, 0.8, 1e-30, 10, "drifting"),
                FeatureDrift("f01", "numeric", 0, None, None, 0, "no values"),
            ),
            _report("v2", FeatureDrift("f00", "numeric", 300, 0.01, 0.7, 10, "ok")),
        ]
    )
    shown = _gauges(metrics)
    assert shown[("servemesh_feature_drift_psi", "*", "f00", "fraud")] == pytest.approx(0.8)
    assert shown[("servemesh_feature_drift_p_value", "v2", "f00", "fraud")] == pytest.approx(0.7)
    assert shown[("servemesh_feature_drift_rows", "*", "f01", "fraud")] == 0
    # Without values there is no PSI to show, rather than a stale or made-up one.
    assert ("servemesh_feature_drift_psi", "*", "f01", "fraud") not in shown
    metrics.publish(
        [_report(None, FeatureDrift("f00", "numeric", 950, 0.7, 1e-25, 10, "drifting"))]
    )
    shown = _gauges(metrics)
    assert {(name, version, feature) for name, version, feature, _ in shown} == {
        ("servemesh_feature_drift_psi", "*", "f00"),
        ("servemesh_feature_drift_p_value", "*", "f00"),
        ("servemesh_feature_drift_rows", "*", "f00"),
    }
