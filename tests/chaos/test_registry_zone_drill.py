"""The registry-zone-loss drill in shortened form against a real local mesh (as
tests/chaos/test_drills.py; a module of its own so it runs beside the others): with the
registry and zone-a's model servers gone, a zone-b model server starts again and another
loads a version again, both from zone-b's mirror of the registry, and calls keep being
answered."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.test_drills import drill, method_output

pytestmark = pytest.mark.mesh


def test_zone_b_model_servers_start_and_load_with_the_registrys_zone_gone(
    tmp_path: Path,
) -> None:
    result = drill("registry-zone-loss", tmp_path, baseline_s=4)
    assert result.verdict == "held", (result.text, result.summary["phases"])
    killed = method_output(result, "lose-the-registry")["killed"]
    assert list(killed) == ["registry-0"], killed
    gone = method_output(result, "lose-zone-a-model-servers")["killed"]
    assert list(gone) == ["model-fraud-zone-a-0"], gone
    # With the registry down, the restarted zone-b model server came up SERVING: every
    # version it serves came from zone-b's mirror.
    started = method_output(result, "it-starts-again-from-the-mirror")
    assert list(started["restarted"]) == ["model-fraud-zone-b-0"], started
    loaded = method_output(result, "another-loads-a-version-again")
    assert loaded["code"] == "OK" and loaded["serving_after"], loaded
    refused = method_output(result, "the-mirror-refuses-a-push")
    assert refused["code"] == "FAILED_PRECONDITION" and "registry" in refused["details"]
    windows = {w["label"]: w for w in result.summary["windows"]}
    down = windows["registry down"]
    assert down["success_pct"] >= 99.5 and down["degraded"] == 0, down
