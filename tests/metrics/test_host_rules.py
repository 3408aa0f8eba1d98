"""The host's headroom alert, evaluated by Prometheus's own rule engine (`promtool test
rules`) on the scaler's gauge: saturated for five minutes tickets with its runbook; a
saturation that comes and goes within them does not."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from servemesh.procs.prometheus import promtool_binary
from servemesh.slo_rules import HOST_ALERT, HOST_RUNBOOK, HOST_SATURATED, render_rules
from servemesh.spec import MeshSpec

PROMTOOL = promtool_binary()


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package `prometheus`)"
)
def test_a_host_saturated_for_five_minutes_tickets_and_a_short_spike_does_not(
    tmp_path: Path,
) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(render_rules(MeshSpec())))

    def series(job: str, values: str) -> dict[str, str]:
        return {"series": f'{HOST_SATURATED}{{job="{job}"}}', "values": values}

    fired = {
        "exp_labels": {"severity": "ticket", "job": "saturated"},
        "exp_annotations": {
            "summary": "the mesh's host has no headroom: the scaler adds no replica",
            "description": "every core busy and a run queue longer than the cores for 5 "
            "minutes; `servemesh scale status` shows the host and each zone's edge",
            "runbook": HOST_RUNBOOK,
        },
    }
    suite = tmp_path / "host_test.yml"
    suite.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules)],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [
                            series("saturated", "0 1x10"),
                            # Saturated for three minutes at a time, never five.
                            series("spiky", "0 1 1 1 0 1 1 1 0 1 1"),
                        ],
                        "alert_rule_test": [
                            {"eval_time": "4m", "alertname": HOST_ALERT, "exp_alerts": []},
                            {"eval_time": "8m", "alertname": HOST_ALERT, "exp_alerts": [fired]},
                        ],
                    }
                ],
            }
        )
    )
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "test", "rules", str(suite)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
