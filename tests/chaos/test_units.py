"""The chaos suite's parts that need no mesh: numbers, the canary build, the drill files."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from chaoslib.experiment import ensure_experiment_is_valid

from servemesh.chaos.canary import failing_threshold, flaky_artifact, parse_flaky_source
from servemesh.chaos.control import _plain
from servemesh.chaos.drill import Drill
from servemesh.chaos.errors import DrillError
from servemesh.chaos.guard import Guard
from servemesh.chaos.mesh import DrillMesh
from servemesh.chaos.report import envoy_deltas, recovery
from servemesh.chaos.runner import list_drills, load_experiment
from servemesh.chaos.scope import describe, select
from servemesh.chaos.timeline import Timeline
from servemesh.cli import main
from servemesh.contract.demo import demo_features
from servemesh.load import Outcome, percentile, window_stats
from servemesh.proxy.apply import RouteManager
from servemesh.spec import MeshSpec

DRILLS = {
    "zone-outage",
    "zone-brownout",
    "zone-proxy-crash",
    "edge-loss",
    "registry-zone-loss",
    "replica-crash-loop",
    "feature-store-down",
    "registry-down",
    "registry-restore",
    "feature-data-loss",
    "feature-primary-loss",
    "bad-canary",
    "inter-zone-partition",
    "rollout-controller-killed",
    "stream-consumer-crash",
    # on containers (chaos/container_actions.py): tests/containers/test_container_drills.py
    "containers-replica-crash",
    "containers-zone-proxy-crash",
    "containers-zone-outage",
    "containers-registry-down",
    "containers-partition",
    "containers-brownout",
}


def calls(start: float, end: float, rate: float, **kw: Any) -> list[Outcome]:
    n = int((end - start) * rate)
    return [Outcome(start + i / rate, 5.0, **kw) for i in range(n)]


def test_window_stats_count_answers_fallbacks_zones_and_failures() -> None:
    outcomes = [
        *calls(0, 1, 10, code="OK", version="v1", zone="zone-a"),
        *calls(1, 2, 10, code="OK", version="fallback", degraded=True),
        *calls(2, 2.5, 10, code="UNAVAILABLE"),
    ]
    stats = window_stats(outcomes, 0, 3)
    assert (stats.sent, stats.ok, stats.failed, stats.degraded) == (25, 20, 5, 10)
    assert stats.success_pct == 80.0 and stats.degraded_pct == 50.0
    assert stats.zones == {"zone-a": 100.0}  # fallbacks were served by no zone
    assert stats.codes == {"UNAVAILABLE": 5}
    assert percentile([1, 2, 3, 4], 50) == 2 and math.isnan(percentile([], 99))


def test_recovery_measures_the_breach_and_the_time_to_recover() -> None:
    healthy = {"code": "OK", "version": "v1"}
    outcomes = [
        *calls(0, 10, 100, zone="zone-a", **healthy),
        *calls(10, 15, 100, code="UNAVAILABLE"),  # the fault: everything fails
        *calls(15, 17, 100, code="UNAVAILABLE"),  # still failing 2 s after the restore
        *calls(17, 30, 100, zone="zone-a", **healthy),
    ]
    result = recovery(outcomes, [(10.0, 15.0)], 30.0, 99.5, {"zone-a": 100.0})
    assert result.slo_breach_s == 7.0
    assert result.time_to_recover_s == 2.0
    assert recovery(outcomes[:1000], [(2.0, 4.0)], 10.0, 99.5, {}).time_to_recover_s == 0.0


def test_traffic_back_is_judged_on_whole_windows() -> None:
    healthy = {"code": "OK", "version": "v1"}
    a, b = calls(0, 30, 50, zone="zone-a", **healthy), calls(0, 30, 50, zone="zone-b", **healthy)
    both = sorted([*a, *b], key=lambda o: o.sent_s)
    down = [o for o in both if not (10 <= o.sent_s < 15 and o.zone == "zone-a")]
    baseline = {"zone-a": 50.0, "zone-b": 50.0}
    assert recovery(down, [(10.0, 15.0)], 30.0, 99.5, baseline).zones_back_s == 0.0
    # Zone-a away until 4 s after the restore: the first 3 s window holding half its share
    # again starts 2 s after.
    slow = [o for o in both if not (10 <= o.sent_s < 19 and o.zone == "zone-a")]
    assert recovery(slow, [(10.0, 15.0)], 30.0, 99.5, baseline).zones_back_s == 2.0
    # A relapse in the drill's last second alone is a window cut short: not judged.
    tail = [o for o in down if not (29 <= o.sent_s and o.zone == "zone-a")]
    assert recovery(tail, [(10.0, 15.0)], 30.0, 99.5, baseline).zones_back_s == 0.0
    # A relapse a whole window long is: not back by the end.
    relapse = [o for o in down if not (26 <= o.sent_s and o.zone == "zone-a")]
    assert recovery(relapse, [(10.0, 15.0)], 30.0, 99.5, baseline).zones_back_s is None


def test_envoy_deltas_sum_by_kind_of_cluster() -> None:
    start = {"cluster.model-fraud-v1-via-zone-a.upstream_rq_retry": 3}
    end = {
        "cluster.model-fraud-v1-via-zone-a.upstream_rq_retry": 10,
        "cluster.model-fraud-v1-via-zone-b.upstream_rq_retry": 2,
        "cluster.feature-via-zone-a.outlier_detection.ejections_enforced_total": 1,
        "cluster.gateway.upstream_rq_pending_overflow": 4,
    }
    delta = envoy_deltas(start, end)
    assert delta["retries"] == {"model": 9}
    assert delta["ejections"] == {"feature": 1}
    assert delta["overflows"] == {"gateway": 4}


def test_the_flaky_canary_fails_exactly_its_share_of_entities_and_passes_warm_up() -> None:
    assert parse_flaky_source("flaky:30") == (30.0, 2)
    with pytest.raises(ValueError):
        parse_flaky_source("flaky:60")  # zeros (the warm-up) would fail
    threshold = failing_threshold(30, 300)
    rows = demo_features(300)
    assert sum(float(r[0]) > threshold for r in rows.values()) == 90
    model = torch.jit.load(io.BytesIO(flaky_artifact(30, 2, 300).data))
    assert model(torch.zeros(4, 64)).shape == (4, 1)
    failing = torch.from_numpy(next(r for r in rows.values() if float(r[0]) > threshold))
    with pytest.raises(torch.jit.Error, match="canary defect"):
        model(failing.unsqueeze(0))


def test_every_drill_is_a_valid_chaos_toolkit_experiment_with_an_slo_and_rollbacks() -> None:
    drills = {d["name"]: d for d in list_drills()}
    assert set(drills) == DRILLS
    for name, info in drills.items():
        experiment = load_experiment(Path(info["file"]))
        ensure_experiment_is_valid(experiment)
        assert info["proves"] and info["slo"].startswith("SLO"), name
        assert experiment["runtime"]["rollbacks"]["strategy"] == "always", name
        assert experiment["rollbacks"], name
        controls = [c["provider"]["module"] for c in experiment["controls"]]
        assert controls == ["servemesh.chaos.control"], name
        assert all("tolerance" in p for p in experiment["steady-state-hypothesis"]["probes"])


def test_chaos_list_shows_every_drill(capsys: pytest.CaptureFixture[str]) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "servemesh", "chaos", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": ""},
    )
    assert shown.returncode == 0, shown.stderr
    for name in DRILLS:
        assert name in shown.stdout
    assert main(["chaos", "list", "-o", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {d["drill"] for d in listed} == DRILLS
    assert all(d["proves"] and d["slo"].startswith("SLO") for d in listed)


def test_a_failed_activity_reads_as_its_message() -> None:
    raw = "chaoslib.exceptions.ActivityFailed: servemesh.chaos.drill.DrillError: no zone 'x'"
    assert _plain(raw) == "no zone 'x'"


def test_the_guard_trips_once_on_a_full_window_below_its_floor() -> None:
    reasons: list[str] = []
    guard = Guard(min_success_pct=95.0, for_s=5.0, max_p99_ms=0.0, on_trip=reasons.append)
    failing = calls(0, 5, 100, code="UNAVAILABLE")
    healthy = calls(0, 5, 100, code="OK", version="v1", zone="zone-a")
    # Too few calls to judge (fewer than half the rate over the window): no verdict yet.
    assert guard.judge(window_stats(failing[:100], 0, 5), rate_per_s=100) == ""
    assert guard.judge(window_stats(healthy, 0, 5), rate_per_s=100) == ""
    reason = guard.judge(window_stats(failing, 0, 5), rate_per_s=100)
    assert reason == "success 0.0% < 95% over the last 5 s"
    guard.trip(reason, at_s=12.3456)
    guard.trip("a second reason", at_s=13.0)
    assert guard.abort.is_set() and guard.tripped and guard.at_s == 12.346
    assert guard.reason == reason and reasons == [reason]
    slow = Guard(min_success_pct=95.0, for_s=5.0, max_p99_ms=1.0)
    assert slow.judge(window_stats(healthy, 0, 5), rate_per_s=100).startswith("p99 5 ms > 1 ms")


def test_the_timeline_keeps_one_window_per_fault_and_closes_what_is_left() -> None:
    now = [1.0]
    timeline = Timeline(lambda: now[0])
    timeline.open_window("kill:model zone-a", "kill model zone-a")
    timeline.open_window("kill:model zone-a", "kill model zone-a")  # applied twice: one window
    now[0] = 2.5
    timeline.open_window("weights:fraud", "fraud: v2 at 10%")
    timeline.close_window("kill:model zone-a")
    timeline.mark("rollbacks", "phase")
    assert timeline.open_labels() == ["fraud: v2 at 10%"]
    assert timeline.spans(4.0) == [(1.0, 2.5), (2.5, 4.0)]
    timeline.close_all(9.0)
    assert [(w.start_s, w.end_s, w.label) for w in timeline.windows] == [
        (1.0, 2.5, "kill model zone-a"),
        (2.5, 9.0, "fraud: v2 at 10% (still open at the end)"),
    ]
    assert [(m.at_s, m.label, m.kind) for m in timeline.marks] == [(2.5, "rollbacks", "phase")]


def test_a_fault_scope_is_a_service_in_a_zone_or_named_replicas() -> None:
    spec = MeshSpec()
    assert [i.name for i in select(spec, "model", "zone-a")] == ["model-fraud-zone-a-0"]
    assert [i.name for i in select(spec, "feature")] == ["feature-zone-a-0", "feature-zone-b-0"]
    assert [i.name for i in select(spec, replicas="gateway-zone-b-0")] == ["gateway-zone-b-0"]
    with pytest.raises(DrillError, match="no zone 'zone-x'"):
        select(spec, "model", "zone-x")
    with pytest.raises(DrillError, match=r"no replicas named \['model-9'\]"):
        select(spec, replicas=["model-9"])
    assert describe("model", "zone-a", None) == "model zone-a"
    assert describe("model", None, ["model-fraud-zone-a-0", "model-fraud-zone-b-0"]) == (
        "model-fraud-zone-a-0, model-fraud-zone-b-0"
    )


def test_a_drill_on_a_zones_own_model_servers_names_the_small_host_profile_when_none() -> None:
    spec = MeshSpec(profile="small-host")
    assert [i.name for i in select(spec, "model")] == ["model-fraud-zone-a-0"]
    with pytest.raises(DrillError, match="no model replicas in zone-b") as err:
        select(spec, "model", "zone-b")
    assert "profile small-host" in str(err.value) and "default profile" in str(err.value)


def test_the_shifted_canary_moves_every_score_and_keeps_them_within_0_and_1() -> None:
    import numpy as np

    from servemesh.chaos.canary import parse_shifted_source, shifted_artifact
    from servemesh.contract.demo import build_fraud_model

    assert parse_shifted_source("shifted:0.3") == (0.3, 1)
    assert parse_shifted_source("shifted:-0.2:2") == (-0.2, 2)
    for bad in ("shifted:0", "shifted:1.5", "shifted:x"):
        with pytest.raises(ValueError, match="shifted"):
            parse_shifted_source(bad)
    rows = torch.from_numpy(np.stack(list(demo_features(50).values())))
    with torch.no_grad():
        original = build_fraud_model(1).eval()(rows)
        shifted = torch.jit.load(io.BytesIO(shifted_artifact(0.3, 1).data))(rows)
    assert torch.allclose(shifted, torch.clamp(original + 0.3, 0.0, 1.0))
    assert float(shifted.max()) <= 1.0 and float((shifted - original).min()) >= 0.0


class _Admins:
    """Stands for the drill's RouteManager: each proxy's admin API by name."""

    def admin_of(self, proxy: str) -> str:
        return proxy


@pytest.mark.parametrize(
    ("layout", "zone_routes", "zone_a", "edges"),
    [
        ("shared", ["envoy"], "envoy", ["envoy"]),
        ("per_zone", ["zone-a", "zone-b"], "zone-a", ["envoy", "edge-zone-b"]),
    ],
)
def test_route_faults_and_zone_probes_go_to_the_envoys_that_serve_them(
    layout: str, zone_routes: list[str], zone_a: str, edges: list[str]
) -> None:
    # A model's route and the feature route live in every zone's mesh listener (each zone's
    # own Envoy in the per-zone layout); the edge route, in every edge's Envoy (one per zone
    # in the per-zone layout).
    spec = MeshSpec.model_validate({"proxy": {"layout": layout}})
    drill = Drill("layout", {"spec": "drill-mesh"})
    drill.mesh = cast(DrillMesh, SimpleNamespace(spec=spec))
    drill.routes = cast(RouteManager, _Admins())
    # (str(): each "admin" here is the proxy's name itself)
    assert [str(a) for a in drill.route_admins("model.fraud")] == zone_routes
    assert [str(a) for a in drill.route_admins("feature")] == zone_routes
    assert [str(a) for a in drill.route_admins("edge")] == edges
    assert str(drill.admin_of_zone("zone-a")) == zone_a


def test_engine_timestamps_compare_whatever_their_fraction_and_zone() -> None:
    """A container's last health check is judged against its start by the engine's stamps:
    nanoseconds, none, `Z` or an offset (chaos/containers.py)."""
    from servemesh.chaos.containers import _when

    started = _when("2026-12-05T22:56:10Z")
    assert _when("2026-12-05T22:56:10.000000001Z") == started  # below a microsecond
    assert _when("2026-12-05T22:56:10.5Z") > started
    assert _when("2026-12-05T22:56:09.999999999Z") < started
    assert _when("2026-12-05T23:56:10.5+01:00") > started
    assert _when("2026-12-05T23:56:09+01:00") < started
