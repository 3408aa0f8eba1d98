"""Drills in shortened form against a real local mesh: verdicts and numbers.

Each drill starts its own mesh (Redis, registry, model servers, features, gateways, Envoy)
on free ports, drives 80 calls/s through its edge, injects its fault for a few seconds and
stops everything by PID. Latency is not asserted here: on a shared 2-core machine another
job's benchmark can stall any process for a second; availability, fallbacks, where traffic
goes and the verdicts are what these tests prove.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from servemesh.chaos.drill import DEFAULTS
from servemesh.chaos.report.numbers import RECOVERY_WINDOW_S
from servemesh.chaos.runner import DrillResult, load_experiment, resolve_experiment, run_drill
from servemesh.proxy.admin import admin_socket_path

pytestmark = pytest.mark.mesh

HERE = Path(__file__).parent
SHORT: dict[str, Any] = {
    "rate": 80,
    "baseline_s": 3,
    "fault_s": 4,
    # The longest recovery watch: it ends once the report's recovery numbers are in (about
    # 4 s on a quiet machine), and a busy one restarting a replica gets the rest. A restarted
    # replica ejected twice on a loaded host sits out 5 s and then 10 s (Envoy doubles the
    # ejection time), so 15 s cut a fresh-clone run's zone-outage watch short with zone-a
    # still out (1.9% of the last window).
    "recover_s": 40,
    "recover_early": True,
    "slo_window_s": 2,
    "tail_s": 0.5,
    # Latency is not what these tests prove (see the module docstring).
    "p99_tolerance_ms": [0, 1900],
}


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:160]}")
    return found


def _listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def _unix_listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(0.2)
        try:
            sock.connect(str(path))
        except OSError:  # no file, or nobody accepting on it
            return False
        return True


def assert_nothing_left(result: DrillResult) -> None:
    """No process of the drill's mesh is alive, none of its ports still listens, and its
    Envoy admin socket answers no more."""
    mesh_dir = result.out_dir.resolve() / "mesh"
    assert not _processes_mentioning(str(mesh_dir)), _processes_mentioning(str(mesh_dir))
    resolved = yaml.safe_load((mesh_dir / "mesh.resolved.yaml").read_text())
    ports = [
        resolved["ports"]["edge"],
        *resolved["mesh_ports"].values(),
        *resolved["instance_ports"].values(),
    ]
    assert not [p for p in ports if _listening(resolved["host"], p)]
    assert not _unix_listening(admin_socket_path(mesh_dir))


def drill(name: str | Path, tmp_path: Path, **variables: Any) -> DrillResult:
    spec = variables.pop("spec", None)
    # The shortened durations, for the keys this drill has.
    known = set(load_experiment(resolve_experiment(name)).get("configuration", {})) | set(DEFAULTS)
    values = {k: v for k, v in {**SHORT, **variables}.items() if k in known}
    result = run_drill(name, out_dir=tmp_path / "run", spec=spec, variables=values)
    assert result.summary, f"no report: {result.text}"
    for key in ("report", "timeline", "summary", "journal"):
        assert Path(result.summary["files"][key]).stat().st_size > 0
    assert_nothing_left(result)
    return result


def explained(result: DrillResult) -> str:
    """The verdict's text with what callers saw (failures by code, fallbacks by reason and
    zones, in each fault window and phase): a drill that fails on a loaded machine says
    why in the test's own output, since its report goes with the test's temporary dir."""
    summary = result.summary or {}
    seen = {"numbers": summary.get("numbers")}
    parts = [(w.get("label", "?"), w) for w in summary.get("windows", [])]
    parts += list(summary.get("phases", {}).items())
    keys = ("sent", "success_pct", "codes", "fallbacks", "zones")
    for label, part in parts:
        seen[label] = {k: part.get(k) for k in keys}
    return f"{result.text}\n{json.dumps(seen, indent=1, default=str)}"


def method_output(result: DrillResult, name: str) -> Any:
    runs = [r for r in result.journal["run"] if r["activity"]["name"] == name]
    assert runs, f"{name} did not run"
    return runs[0]["output"]


def test_zone_outage_is_invisible_and_traffic_comes_back(tmp_path: Path) -> None:
    result = drill("zone-outage", tmp_path)
    assert result.verdict == "held", explained(result)
    summary = result.summary
    (outage,) = summary["windows"]
    assert outage["label"] == "kill model zone-a"
    assert outage["sent"] >= 300
    assert outage["success_pct"] >= 99.5, outage["codes"]
    assert outage["degraded"] == 0
    # Traffic moved: the last 2 s of the outage were all served by zone-b.
    assert method_output(result, "other-zone-share-while-down-pct") == 100.0
    # ... and came back: zone-a serves its share again after the restart.
    after = summary["phases"]["after faults"]
    assert after["zones"].get("zone-a", 0) > 25, after["zones"]
    # The recovery watch ended once its numbers were in, not at its longest.
    watch = method_output(result, "watch-the-recovery")
    assert watch["recovered"] is True and watch["interrupted"] is False, watch
    assert watch["end_s"] - watch["start_s"] < SHORT["recover_s"], watch
    # Traffic came back within three of the report's whole windows. Usually it is the
    # first that starts once the replicas were up again (a fresh-clone run read 3.5 s); but
    # a restarted replica that fails its first call on a loaded host is ejected, and sits
    # out the outlier's base ejection time (5 s: a passing health check does not let it
    # back early, by design), which a fresh-clone run read as 6.7 s.
    back = summary["numbers"]["zones_back_s"]
    report = Path(summary["files"]["report"]).read_text()
    assert back is not None and back <= 3 * RECOVERY_WINDOW_S, report
    assert summary["numbers"]["failed"] <= summary["numbers"]["sent"] * 0.005


def test_feature_store_down_answers_fallbacks_then_real_scores(tmp_path: Path) -> None:
    result = drill("feature-store-down", tmp_path)
    assert result.verdict == "held", explained(result)
    summary = result.summary
    (outage,) = summary["windows"]
    assert outage["label"] == "Redis down"
    assert outage["success_pct"] >= 99.5, outage["codes"]
    # While Redis is down (past the first second) callers get the fallback, marked degraded.
    assert method_output(result, "fallback-answers-while-down-pct") >= 95
    assert outage["degraded"] >= 0.8 * outage["sent"]
    # Real scores again after the restart (from its snapshot: entities still found). The
    # feature replicas said NOT_SERVING while Redis was down, so fallbacks go on until they
    # probe it back and Envoy's health checks let them in again: about a second, within the
    # three the recovery may take.
    after = summary["phases"]["after faults"]
    assert after["failed"] == 0 and after["degraded"] <= 3 * SHORT["rate"], after
    assert summary["numbers"]["time_to_recover_s"] is not None
    assert summary["numbers"]["time_to_recover_s"] <= 3


def test_feature_data_loss_is_restored_from_its_backup_with_rpo_and_rto(tmp_path: Path) -> None:
    result = drill("feature-data-loss", tmp_path)
    assert result.verdict == "held", explained(result)
    summary = result.summary
    (loss,) = summary["windows"]
    assert loss["label"] == "feature data lost"
    # While the data was gone callers were told so (NOT_FOUND names the entity), never
    # answered a made-up score.
    assert loss["degraded"] == 0
    assert set(loss["codes"]) <= {"OK", "NOT_FOUND"}, loss["codes"]
    assert method_output(result, "answered-while-lost-pct") == 0.0
    came_back = method_output(result, "what-came-back")
    assert came_back["ok"] is True and came_back["missing"] == 0, came_back
    assert came_back["backed_up"] > 100, came_back  # the demo's rows and views
    assert came_back["lost_after_backup"] == ["fs:drill-late-row"], came_back
    assert came_back["rto_s"] is not None and came_back["rpo_s"] is not None
    assert "RTO:" in (result.out_dir / "feature-restore.md").read_text()
    # Real scores again once the restore wrote the keys back.
    after = summary["phases"]["after faults"]
    assert after["failed"] == 0 and after["degraded"] == 0, after
    assert summary["numbers"]["time_to_recover_s"] is not None


def test_feature_primary_loss_during_a_load_fails_no_predict_and_loses_no_row(
    tmp_path: Path,
) -> None:
    # A smaller load than the drill's default (150,000 rows): the suite runs drills side by
    # side, and two loads of that size with their replication take CPU the other drills'
    # timing needs. The kill still lands while the load's process runs (asserted below).
    result = drill("feature-primary-loss", tmp_path, rows=40_000, kill_after_s=0.5)
    assert result.verdict == "held", explained(result)
    summary = result.summary
    (loss,) = summary["windows"]
    assert loss["label"] == "store primary redis lost"
    # Predicts read the zones' replicas: not one failed or fell back.
    assert loss["failed"] == 0 and loss["degraded"] == 0, loss["codes"]
    killed = method_output(result, "kill-the-store-primary")
    assert killed["killed"] == "redis" and killed["load_running"] is True, killed
    promoted = method_output(result, "await-a-new-primary")
    assert promoted["primary"].startswith("redis-replica-"), promoted
    loaded = method_output(result, "finish-the-feature-load")
    # The load finished, or failed saying why and was run again: every row served after.
    tries = loaded["tries"]
    assert tries[-1]["exit"] == 0, tries
    assert all(t["said"].startswith("not loaded: ") for t in tries[:-1]), tries
    assert loaded["rows_served"] == loaded["rows_in_file"] and loaded["lost"] == 0, loaded
    assert "rows served after it" in (result.out_dir / "store-failover.md").read_text()
    after = summary["phases"]["after faults"]
    assert after["failed"] == 0, after


def test_bad_canary_is_rolled_back_by_the_controller_with_bounded_damage(tmp_path: Path) -> None:
    result = drill("bad-canary", tmp_path)
    assert result.verdict == "held", explained(result)
    summary = result.summary
    (rollout,) = summary["windows"]
    assert rollout["label"] == "fraud: rollout of v2"
    # The controller, not a scripted step, rolled it back: exit 3, naming the failed check.
    outcome = method_output(result, "roll-out-the-canary")
    assert outcome["exit"] == 3 and outcome["outcome"] == "rolled back", outcome
    assert "error_ratio fail" in outcome["reason"], outcome
    # v2 fails on 30% of entities and got 10% of them: some calls fell back, never more
    # than the canary's weight; every call is still answered.
    assert rollout["failed"] == 0
    assert 0 < rollout["degraded"] and rollout["degraded_pct"] <= 10.0, rollout
    assert 0 < rollout["versions"].get("v2", 0) <= 14.0, rollout["versions"]
    # After the rollback the defect reaches nobody: v1 answers every real score, and no
    # fallback comes from a failed inference (the canary's defect; callers see its kind,
    # never the model's message). A fallback for another reason (a model server shedding
    # load while a loaded host stalls it) is not the canary's; the steady state's last
    # window bounds those.
    during = summary["phases"]["during faults"]
    assert any("inference failed" in reason for reason in during["fallbacks"]), during
    after = summary["phases"]["after faults"]
    assert set(after["versions"]) <= {"v1", "fallback"}, after
    assert after["versions"].get("v1", 0) > 90.0, after
    defect = {r: n for r, n in after["fallbacks"].items() if "inference failed" in r}
    assert not defect, after["fallbacks"]
    assert summary["numbers"]["time_to_recover_s"] is not None
    assert summary["numbers"]["time_to_recover_s"] <= 2


def test_without_retries_a_zone_outage_deviates(tmp_path: Path) -> None:
    # Without retries an outage costs a handful of calls: those in flight on the dead
    # replica and the few that trip outlier detection. Over a 1 s outage (plus the restart)
    # that is well above the 0.5% of fallbacks the drill's SLO allows; with retries, none.
    spec = str(HERE / "specs" / "no-retries.yaml")
    result = drill("zone-outage", tmp_path, spec=spec, fault_s=1)
    assert result.verdict == "deviated", result.text
    assert "during-faults-pct" in result.text
    (outage,) = result.summary["windows"]
    # The calls zone-a's gateway sent before Envoy gave up on the dead replica were lost
    # (answered by the fallback or failed) instead of retried in zone-b.
    assert outage["degraded"] + outage["failed"] > 0.005 * outage["sent"]


def test_the_guard_stops_the_method_and_runs_the_rollbacks(tmp_path: Path) -> None:
    result = drill(HERE / "experiments" / "guard-abort.yaml", tmp_path)
    assert result.verdict == "aborted", result.text
    summary = result.summary
    guard = summary["guard"]
    assert guard["tripped"] and "success" in guard["reason"]
    (fault,) = summary["windows"]
    # Tripped within a few seconds of the fault (2 s window), not after its 60 s.
    assert guard["at_s"] - fault["start_s"] < 6, (guard, fault)
    names = [r["activity"]["name"] for r in result.journal["run"]]
    assert "never-reached" not in names
    hold = method_output(result, "hold-the-fault")
    assert hold["interrupted"] is True
    rollbacks = result.journal["rollbacks"]
    assert [r["activity"]["name"] for r in rollbacks] == ["clear-the-edge-fault"]
    assert rollbacks[0]["status"] == "succeeded"
    assert fault["end_s"] is not None and fault["end_s"] - fault["start_s"] < 10
    # Once the rollback cleared the fault, calls succeed again.
    assert summary["phases"]["after faults"]["success_pct"] >= 99.0
    assert "aborted by the guard" in result.text
