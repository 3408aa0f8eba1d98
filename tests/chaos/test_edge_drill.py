"""The edge-loss drill in shortened form against a real local mesh with an edge per zone
(as tests/chaos/test_drills.py; a module of its own so it runs beside the others): zone-a's
edge Envoy is SIGKILLed under load from a caller given every edge's address and held down,
no call is lost, and callers come back to it once it runs again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.test_drills import drill, method_output

pytestmark = pytest.mark.mesh


def test_a_killed_edge_loses_no_call_of_a_caller_given_every_edge(tmp_path: Path) -> None:
    result = drill("edge-loss", tmp_path, baseline_s=4, down_s=5)
    windows = {w["label"]: w for w in result.summary["windows"]}
    crash = windows["kill zone-a's edge"]
    assert result.verdict == "held", (result.text, crash, result.summary["phases"])
    # Calls were sent while the edge was gone, and every one was answered for real.
    assert crash["sent"] >= 200, crash
    assert crash["success_pct"] == 100.0, crash["codes"]
    assert crash["degraded"] == 0, crash
    after = result.summary["phases"]["after faults"]
    assert after["failed"] == 0 and after["degraded"] == 0, after
    killed = method_output(result, "kill-the-zones-edge")["killed"]["envoy"]
    back = method_output(result, "the-edge-serves-again")
    assert back["pid"] != killed and back["seconds"] < 30, back
    # The caller spread over both edges again: the restarted edge (a new process, its
    # counters from zero) took calls in the 10 s after it was back.
    taken = method_output(result, "calls-each-edge-took")
    assert set(taken) == {"envoy", "edge-zone-b"}, taken
    assert all(count > 0 for count in taken.values()), taken
