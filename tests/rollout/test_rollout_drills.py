"""The rollout drill in shortened form: a controller killed mid-rollout, then `rollout
resume`, against a mesh of the drill's own under steady load (tests/chaos/test_drills.py
runs the other drills, the bad canary's automated rollback among them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.test_drills import drill, method_output

pytestmark = pytest.mark.mesh


def test_a_killed_controller_is_resumed_and_not_one_call_fails(tmp_path: Path) -> None:
    result = drill("rollout-controller-killed", tmp_path, unattended_s=3, recover_s=2)
    assert result.verdict == "held", (result.text, result.summary["numbers"])
    killed = method_output(result, "kill-the-controller")
    assert killed["step"] == "50%" and killed["weights"] == {"v1": 50, "v2": 50}
    # While nobody drove it, Envoy kept the split the controller last set.
    unattended = method_output(result, "nobody-drives-it")
    assert unattended["failed"] == 0 and unattended["degraded"] == 0
    assert 30 <= unattended["versions"].get("v2", 0) <= 70, unattended["versions"]
    resumed = method_output(result, "rollout-resume")
    assert resumed["exit"] == 0 and resumed["reason"].startswith("promoted:"), resumed
    after = method_output(result, "new-version-share-after-pct")
    assert after["versions"] == {"v2": 100.0}
    numbers = result.summary["numbers"]
    assert numbers["sent"] > 0 and numbers["failed"] == 0
