"""The zone-proxy-crash drill in shortened form against a real local mesh with an Envoy per
zone (as tests/chaos/test_drills.py; a module of its own so it runs beside the others):
zone-a's Envoy is SIGKILLed under load, the mesh starts it again, the steady state holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.test_drills import drill, method_output

pytestmark = pytest.mark.mesh


def test_a_killed_zone_envoy_costs_its_zone_seconds_and_the_mesh_starts_it_again(
    tmp_path: Path,
) -> None:
    # An Envoy per zone: zone-a's is SIGKILLed under load; the mesh starts it by itself.
    result = drill("zone-proxy-crash", tmp_path, baseline_s=4)
    (crash,) = result.summary["windows"]
    # On a deviation, the fault window's failures by status and its phases say which hop
    # failed (one fresh-clone run under the whole suite answered 96.8%, and said no more).
    assert result.verdict == "held", (result.text, crash, result.summary["phases"])
    assert crash["label"] == "kill zone-a's Envoy"
    assert crash["success_pct"] >= 99.5, crash["codes"]
    assert crash["degraded"] == 0, crash
    killed = method_output(result, "kill-the-zones-envoy")["killed"]["envoy-zone-a"]
    back = method_output(result, "the-mesh-starts-it-again")
    assert back["pid"] != killed and back["seconds"] < 30, back
    # Zone-a serves again after the restart: the phase's share is below an even split (the
    # edge's outlier detection sat zone-a's gateway out for its ejection time after its
    # failed calls), and the verdict held on its last window's share of at least 20%.
    after = result.summary["phases"]["after faults"]
    assert after["zones"].get("zone-a", 0) > 10, after["zones"]
