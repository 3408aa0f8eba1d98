"""The drills of slow and crashing parts, in shortened form against a real local mesh (as
tests/chaos/test_drills.py; a module of its own so the two run side by side): a zone
brownout hedged to the other zone, a replica in a crash loop, the registry down."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.test_drills import drill, method_output

pytestmark = pytest.mark.mesh


def test_a_zone_brownout_is_hedged_to_the_other_zone(tmp_path: Path) -> None:
    # +200 ms on every model replica of zone-a for 5 s; the drill mesh hedges a ModelInfer
    # still out after 20 ms to zone-b.
    result = drill("zone-brownout", tmp_path, fault_s=5, baseline_s=4)
    assert result.verdict == "held", result.text
    (brownout,) = result.summary["windows"]
    assert brownout["failed"] == 0 and brownout["degraded"] == 0, brownout
    # Hedges answered from zone-b (without hedging zone-a still answers about a quarter of
    # the window's calls, 200 ms late). The fault window's p99 against the baseline's is the
    # full-length drill's number (docs/benchmarks.md): on a shared 2-core machine a short
    # window's p99 is one stalled call, so latency is not asserted (module docstring).
    assert brownout["zones"].get("zone-b", 0) >= 90, brownout["zones"]
    ratio = method_output(result, "p99-against-the-baseline")
    assert ratio["baseline_p99_ms"] > 0 and ratio["fault_p99_ms"] > 0, ratio
    before = method_output(result, "envoy-before-brownout")
    during = method_output(result, "envoy-during-brownout")
    # Envoy steers around the brownout: the share of ModelInfer calls hedged during it is
    # above the share before it, or outlier detection ejected zone-a's slow replicas (hedged
    # tries count toward it; once they are out, calls go to zone-b unhedged). (The goal, at
    # most 10% more calls outside the fault, is the full-length drill's number in
    # docs/benchmarks.md: in a shortened drill on a busy machine, how many calls pass the
    # 20 ms per-try timeout is the machine's load.)
    before_share = before["retries"]["model"] / max(1, before["requests"]["model"])
    hedged = during["retries"]["model"] - before["retries"]["model"]
    calls = during["requests"]["model"] - before["requests"]["model"]
    ejected = during["ejections"]["model"] - before["ejections"]["model"]
    assert hedged / max(1, calls) > before_share or ejected > 0, (before, during)


def test_a_replica_in_a_crash_loop_never_reaches_callers(tmp_path: Path) -> None:
    result = drill("replica-crash-loop", tmp_path, fault_s=5, up_s=2, down_s=1)
    assert result.verdict == "held", result.text
    (loop,) = result.summary["windows"]
    assert loop["success_pct"] >= 99.5, loop["codes"]
    assert loop["degraded"] <= 0.005 * loop["sent"], loop


def test_with_the_registry_down_serving_goes_on_and_a_new_load_fails_cleanly(
    tmp_path: Path,
) -> None:
    result = drill("registry-down", tmp_path, model_load_timeout_s=3)
    assert result.verdict == "held", result.text
    (outage,) = result.summary["windows"]
    assert outage["failed"] == 0 and outage["degraded"] == 0, outage
    assert method_output(result, "a-new-load-fails-cleanly") is True
    assert method_output(result, "a-load-works-again")["code"] == "OK"
