"""The host's headroom alert, evaluated by Prometheus's own rule engine (`promtool test
rules`) on the scaler's gauge: saturated for five minutes tickets with its runbook; a
saturation that comes and goes within them does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from servemesh.slo_rules import HOST_ALERT, HOST_RUNBOOK, HOST_SATURATED
from servemesh.spec import MeshSpec
from tests.metrics.promtool_rules import NO_PROMTOOL, PROMTOOL, run_rule_tests, series


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_a_host_saturated_for_five_minutes_tickets_and_a_short_spike_does_not(
    tmp_path: Path,
) -> None:
    fired = {
        "exp_labels": {"severity": "ticket", "job": "saturated"},
        "exp_annotations": {
            "summary": "the mesh's host has no headroom: the scaler adds no replica",
            "description": "every core busy and a run queue longer than the cores for 5 "
            "minutes; `servemesh scale status` shows the host and each zone's edge",
            "runbook": HOST_RUNBOOK,
        },
    }
    tests = [
        {
            "interval": "1m",
            "input_series": [
                series(HOST_SATURATED, "0 1x10", job="saturated"),
                # Saturated for three minutes at a time, never five.
                series(HOST_SATURATED, "0 1 1 1 0 1 1 1 0 1 1", job="spiky"),
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": HOST_ALERT, "exp_alerts": []},
                {"eval_time": "8m", "alertname": HOST_ALERT, "exp_alerts": [fired]},
            ],
        }
    ]
    done = run_rule_tests(tmp_path, MeshSpec(), tests)
    assert done.returncode == 0, done.stdout + done.stderr
