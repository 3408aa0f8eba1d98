"""`servemesh capacity plan` end to end: a step load on a mesh of its own (one replica of
each kind, real Envoy, Redis and services), a plan per kind with its cost, the
measurement kept in the state dir and planned from again without a load; a plan with
no step inside the SLO refused with exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

RUN = [sys.executable, "-m", "servemesh", "capacity", "plan"]


def plan(spec: Path, state: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RUN, "--spec", str(spec), "--state-dir", str(state), *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_step_load_gives_replicas_per_kind_and_their_cost(tmp_path: Path) -> None:
    spec = tmp_path / "mesh.yaml"
    spec.write_text(yaml.safe_dump({"demo": {"entities": 100}, "cost": {"per_core_hour": 0.1}}))
    state = tmp_path / "state"
    # A loose SLO: every step is within it, so the probe stops at --max-steps.
    flags = ["--rps", "1000", "--p99-ms", "5000", "--start-rps", "20", "--factor", "2"]
    done = plan(spec, state, *flags, "--step-s", "1", "--max-steps", "3", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    found: dict[str, Any] = json.loads(done.stdout)
    steps = found["steps"]
    assert [s["rate_rps"] for s in steps] == [20, 40, 80]
    assert all(s["ok"] == s["calls"] == round(s["rate_rps"]) for s in steps)
    assert found["plan"]["knee_rps"] == 80
    kinds = {k["kind"]: k for k in found["plan"]["kinds"]}
    assert {"gateway", "feature", "model", "envoy", "redis"} <= set(kinds)
    for kind in kinds.values():
        # Enough replicas for the rate with the default 30% left free.
        assert kind["replicas"] * kind["rps_per_replica"] * 0.7 >= 1000 - 1e-6
        assert 0 <= kind["utilisation"] <= 0.7 + 1e-3
    assert kinds["gateway"]["utilisation"] > 0 and kinds["model"]["utilisation"] > 0
    assert found["plan"]["cost_per_hour"] > 0
    assert found["plan"]["prices"]["per_core_hour"] == 0.1
    recorded = json.loads((state / "capacity" / "fraud.json").read_text())
    assert recorded["capacity"]["model"]["rps_per_replica"] == kinds["model"]["rps_per_replica"]

    # Twice the rate from the same measurement: no load, twice the model servers or more.
    again = plan(spec, state, "--rps", "2000", "--p99-ms", "5000", "--measured", "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    doubled = {k["kind"]: k for k in json.loads(again.stdout)["plan"]["kinds"]}
    assert doubled["gateway"]["replicas"] >= kinds["gateway"]["replicas"]
    assert json.loads(again.stdout)["steps"] == steps

    # An SLO no step met: nothing to plan from.
    refused = plan(spec, state, "--rps", "1000", "--p99-ms", "0.001", "--measured")
    assert refused.returncode == 1
    assert "no step within p99 0.001 ms" in refused.stderr + refused.stdout
