"""Blue-green and rolling updates against a real mesh under a steady open-loop load.

One mesh for the module (one zone, two model servers for fraud, one for risk on a pool of
its own), its tests in order: a blue-green update whose check fails switches back and drops
its set; one that holds switches in one route change while the old set keeps answering; the
old set is retired; a rolling update replaces each replica once; and stopping the mesh
leaves none of the replicas it started. Every test asserts that no call of the load failed,
and the updates of fraud start, stop and rename nothing of risk's pool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from servemesh.cli import main
from servemesh.contract.wire import model_cluster
from servemesh.identity import dial_edge
from servemesh.identity.edge_client import dial_edge_as
from servemesh.launcher import Mesh
from servemesh.load import BackgroundLoad, Outcome, predict_target
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.replicas import envoy_hosts
from servemesh.rollout.fleet import (
    GREEN_READY,
    GREEN_STARTED,
    ROLLING_REPLACED,
    SWITCHED,
    SWITCHED_BACK,
    StrategyContext,
    fleet_status,
    run_blue_green,
    run_rolling,
)
from servemesh.rollout.types import Check, Ending
from servemesh.rollout.types import Outcome as RolloutOutcome
from servemesh.spec import (
    DemoSpec,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    PoolSpec,
    Ports,
    Replicas,
)
from servemesh.spec.rollout_plan import RolloutPlan
from servemesh.state.paths import MeshPaths
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.waiting import wait_until

pytestmark = pytest.mark.mesh

ENTITIES = 50
RATE_PER_S = 30.0
ZONE = "zone-a"
BLUE = ["model-fraud-zone-a-0", "model-fraud-zone-a-1"]
GREEN = ["model-fraud-green-zone-a-0", "model-fraud-green-zone-a-1"]
# The other pool's one server: no update of fraud may start, stop or rename anything of it.
RISK = "model-risk-zone-a-0"


def fleet_mesh_spec(state_dir: Path) -> MeshSpec:
    """One zone, two model servers (a rolling update takes one out at a time), one of every
    other service; fraud v1 takes all traffic, v2 none."""
    one = Replicas(per_zone={ZONE: 1})
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(state_dir),
        zones=[ZONE],
        gateway=one,
        feature=one,
        model_servers=Replicas(per_zone={ZONE: 2}),
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="demo:2"),
                },
                traffic={"v1": 100, "v2": 0},
            ),
            "risk": ModelSpec(
                versions={"v1": ModelVersionSpec(source="demo:3")}, traffic={"v1": 100}
            ),
        },
        pools={"risk": PoolSpec(per_zone={ZONE: 1})},
        demo=DemoSpec(enabled=True, entities=ENTITIES),
    )
    return spec.model_copy(
        update={"metrics": spec.metrics.model_copy(update={"prometheus": "off"})}
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with Mesh.from_spec(fleet_mesh_spec(tmp_path_factory.mktemp("fleet-mesh"))) as running:
        yield running


@pytest.fixture
def manager(mesh: Mesh) -> RouteManager:
    return RouteManager(MeshPaths(mesh.state_dir))


@contextmanager
def steady_load(mesh: Mesh) -> Iterator[BackgroundLoad]:
    """An open loop through the edge, started once the first calls are answered."""
    running = BackgroundLoad(
        predict_target(dial_edge(mesh.spec), entities=ENTITIES, timeout_s=5.0),
        rate_per_s=RATE_PER_S,
    )
    running.start()
    try:
        wait_until(lambda: sum(o.ok for o in running.outcomes) >= 20, "the load's first answers")
        yield running
    finally:
        running.stop()


def finished(load: BackgroundLoad) -> list[Outcome]:
    """Stop the load; every call it sent (all answered), none failed."""
    load.stop()
    assert not load.error, load.error
    outcomes = load.snapshot()
    assert len(outcomes) == load.sent
    failed = [(round(o.sent_s, 3), o.code) for o in outcomes if not o.ok]
    assert failed == [], f"{len(failed)} of {len(outcomes)} calls failed: {failed[:10]}"
    return outcomes


class Recorder:
    """The controller's side of a StrategyContext: progress lines and durable markers."""

    def __init__(self, clock: Callable[[], float] = lambda: 0.0) -> None:
        self.lines: list[str] = []
        self.markers: list[tuple[str, dict[str, Any]]] = []
        self.clock = clock  # the load's, so a marker's time compares with calls' sent_s
        self.at: dict[str, float] = {}

    def say(self, line: str) -> None:
        self.lines.append(line)

    def record(self, marker: str, data: dict[str, Any]) -> None:
        self.markers.append((marker, data))
        self.at[marker] = self.clock()

    def names(self) -> list[str]:
        return [m for m, _ in self.markers]


def context(
    manager: RouteManager, recorder: Recorder, version: str, baseline: str, **extra: Any
) -> StrategyContext:
    return StrategyContext(
        manager=manager,
        spec=manager.live_spec(),
        model="fraud",
        version=version,
        baseline=baseline,
        plan=RolloutPlan(strategy="blue-green"),
        say=recorder.say,
        record=recorder.record,
        ready_timeout_s=120.0,
        **extra,
    )


def weight_changes(manager: RouteManager, after_id: int) -> list[dict[str, Any]]:
    """History entries after `after_id` that moved fraud's weights."""
    return [
        e
        for e in manager.history()
        if e["id"] > after_id
        and e["before"]["models"]["fraud"]["traffic"] != e["after"]["models"]["fraud"]["traffic"]
    ]


def last_id(manager: RouteManager) -> int:
    return max((int(e["id"]) for e in manager.history()), default=0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def predict(mesh: Mesh, version: str = "") -> gateway_pb2.PredictResponse:
    # A pinned version may have no share of the split: only the operator pins those.
    dial = dial_edge_as(mesh.spec, mesh.spec.edge_address) if version else dial_edge(mesh.spec)
    with dial.channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        reply: gateway_pb2.PredictResponse = stub.Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"], version=version),
            timeout=5,
        )
        return reply


def test_a_failed_check_switches_back_in_one_change_and_drops_the_green_set(
    mesh: Mesh, manager: RouteManager
) -> None:
    recorder = Recorder()
    failed_check = Ending(
        RolloutOutcome.ROLLED_BACK,
        "error_ratio: error ratio 30.1% vs baseline 0.0% (+30.1 points > +0.1)",
        (Check("error_ratio", "fail", "error ratio 30.1% vs baseline 0.0%"),),
    )
    seen_at_watch: dict[str, int] = {}
    before = last_id(manager)
    with steady_load(mesh) as load:

        def watch() -> Ending:
            # The controller's analysis runs while the new version takes every call.
            seen_at_watch.update(manager.live_spec().models["fraud"].traffic)
            wait_until(
                lambda: sum(1 for o in list(load.outcomes) if o.version == "v2") >= 20,
                "calls answered by v2",
            )
            return failed_check

        ending = run_blue_green(context(manager, recorder, "v2", "v1", watch=watch))
        outcomes = finished(load)

    assert ending == failed_check
    assert seen_at_watch == {"v1": 0, "v2": 100}
    assert recorder.names() == [GREEN_STARTED, GREEN_READY, SWITCHED, SWITCHED_BACK]
    # The switch and the switch back: one route change each.
    moves = weight_changes(manager, before)
    assert [e["after"]["models"]["fraud"]["traffic"] for e in moves] == [
        {"v1": 0, "v2": 100},
        {"v1": 100, "v2": 0},
    ]
    # Green answered while it had the traffic; blue before and after.
    assert {o.replica for o in outcomes if o.version == "v2"} <= set(GREEN)
    assert {o.replica for o in outcomes if o.version == "v1"} <= set(BLUE)
    # The failed version's set goes: the mesh stopped its replicas by PID.
    live = manager.live_spec()
    assert [s.name for s in live.fleet.sets] == [""]
    wait_until(lambda: not set(GREEN) & set(fleet_status(mesh.state_dir)), "green stopped")
    assert not set(GREEN) & set(mesh.pids())


class ControllerCrash(Exception):
    """The controller died right after it recorded a step."""


def test_blue_green_switches_in_one_change_and_the_old_set_keeps_answering(
    mesh: Mesh, manager: RouteManager
) -> None:
    blue_pids = {name: mesh.pid(name) for name in BLUE}
    risk_pid = mesh.pid(RISK)
    before = last_id(manager)

    def crash_after_start(marker: str, data: dict[str, Any]) -> None:
        recorder.record(marker, data)
        raise ControllerCrash(marker)

    def calls_after(at_s: float, count: int = 30) -> None:
        wait_until(
            lambda: sum(1 for o in list(load.outcomes) if o.sent_s > at_s) >= count,
            f"{count} calls answered after {at_s:.2f} s",
        )

    with steady_load(mesh) as load:
        recorder = Recorder(load.now_s)
        # The first controller dies once the green set is asked for; the mesh starts it
        # anyway, and a resumed update takes it as it is instead of starting another.
        crashing = context(manager, recorder, "v2", "v1")
        crashing.record = crash_after_start
        with pytest.raises(ControllerCrash):
            run_blue_green(crashing)
        wait_until(lambda: set(GREEN) <= set(fleet_status(mesh.state_dir)), "green started")
        started = {n: fleet_status(mesh.state_dir)[n]["pid"] for n in GREEN}
        resumed = context(manager, recorder, "v2", "v1", resume_from=GREEN_STARTED)
        ending = run_blue_green(resumed)
        assert ending.outcome == RolloutOutcome.PROMOTED, ending.reason
        assert {n: fleet_status(mesh.state_dir)[n]["pid"] for n in GREEN} == started
        switched_at = recorder.at[SWITCHED]
        calls_after(switched_at)
        # The old set still serves the baseline: a pinned call, and the switch back.
        assert predict(mesh, "v1").model_replica in BLUE
        back_from = load.now_s()
        back = manager.set_weights("fraud", {"v1": 100})
        back_at = load.now_s()
        calls_after(back_at)
        forward_from = load.now_s()
        forward = manager.set_weights("fraud", {"v2": 100})
        forward_at = load.now_s()
        calls_after(forward_at)
        outcomes = finished(load)

    assert recorder.names() == [GREEN_STARTED, GREEN_READY, SWITCHED]
    # One set started, one switch.
    starts = [e for e in manager.history() if e["id"] > before and "start set" in e["action"]]
    assert len(starts) == 1
    moves = weight_changes(manager, before)
    # The switch is one route change; so are the switch back and forth by hand.
    assert [e["after"]["models"]["fraud"]["traffic"] for e in moves] == [
        {"v1": 0, "v2": 100},
        {"v1": 100, "v2": 0},
        {"v1": 0, "v2": 100},
    ]
    assert back.confirm_ms < 5000 and forward.confirm_ms < 5000

    def answered(start_s: float, end_s: float) -> set[tuple[str, str]]:
        return {(o.version, o.replica) for o in outcomes if start_s < o.sent_s < end_s}

    # Until the green set was warm, the blue set answered v1; once each switch was
    # confirmed, every call went to the set it names, at once.
    assert {v for v, _ in answered(0, recorder.at[GREEN_READY])} == {"v1"}
    assert {v for v, _ in answered(switched_at, back_from)} == {"v2"}
    assert {r for _, r in answered(switched_at, back_from)} <= set(GREEN)
    assert {v for v, _ in answered(back_at, forward_from)} == {"v1"}
    assert {r for _, r in answered(back_at, forward_from)} <= set(BLUE)
    assert {v for v, _ in answered(forward_at, float("inf"))} == {"v2"}
    assert {r for _, r in answered(forward_at, float("inf"))} <= set(GREEN)
    assert {r for v, r in answered(0, float("inf")) if v == "v1"} <= set(BLUE)
    # Blue never restarted; green runs beside it, each with its own PID.
    assert {name: mesh.pid(name) for name in BLUE} == blue_pids
    status = fleet_status(mesh.state_dir, "model")
    # fraud's pool got a second set; risk's pool started nothing and lost nothing.
    assert set(status) == set(BLUE) | set(GREEN) | {RISK}
    assert all(alive(int(status[n]["pid"] or 0)) for n in GREEN)
    assert mesh.pid(RISK) == risk_pid
    # Envoy: v2's cluster lists the green replicas only, v1's the blue ones.
    live = manager.live_spec()
    hosts = envoy_hosts(manager)
    address = {n: f"{live.host_of(n)}:{live.port_of(n)}" for n in BLUE + GREEN}
    assert set(hosts[model_cluster("fraud", "v2", ZONE)]) == {address[n] for n in GREEN}
    assert set(hosts[model_cluster("fraud", "v1", ZONE)]) == {address[n] for n in BLUE}


def test_fleet_show_lists_both_sets(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--state-dir", str(mesh.state_dir), "show", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["set"], r["pool"], r["replica"], r["pid"]) for r in rows] == [
        ("first", "fraud", name, mesh.pid(name)) for name in BLUE
    ] + [("first", "risk", RISK, mesh.pid(RISK))] + [
        ("green", "fraud", name, mesh.pid(name)) for name in GREEN
    ]
    serves = {r["replica"]: r["serves"] for r in rows}
    assert serves[BLUE[0]] == "every other version" and serves[RISK] == "every version"
    assert {r["serves"] for r in rows if r["set"] == "green"} == {"fraud v2"}
    # Green is a host of v2's cluster alone; blue of v1's and of the replicas' own cluster.
    assert {r["healthy_in_clusters"] for r in rows if r["set"] == "green"} == {"1/1"}
    assert {r["healthy_in_clusters"] for r in rows if r["set"] == "first"} == {"2/2"}


def test_retiring_the_old_set_leaves_the_green_set_alone(
    mesh: Mesh, manager: RouteManager, capsys: pytest.CaptureFixture[str]
) -> None:
    blue_pids = [mesh.pid(name) for name in BLUE]
    risk_pid = mesh.pid(RISK)
    with steady_load(mesh) as load:
        assert main(["fleet", "--state-dir", str(mesh.state_dir), "retire"]) == 0
        said = capsys.readouterr().out
        assert "pool 'fraud' runs on set 'green' now" in said
        assert "stopping model-fraud-zone-a-0, model-fraud-zone-a-1" in said
        retired_at = load.now_s()
        wait_until(
            lambda: sum(1 for o in list(load.outcomes) if o.sent_s > retired_at) >= 30,
            "calls after the retirement",
        )
        outcomes = finished(load)

    live = manager.live_spec()
    assert [(s.name, s.serves) for s in live.fleet.sets] == [("", {})]
    assert live.fleet.homes == {"fraud": "green"}
    assert [i.name for i in live.instances() if i.service == "model"] == [*GREEN, RISK]
    assert not any(alive(pid) for pid in blue_pids)
    assert set(fleet_status(mesh.state_dir, "model")) == {*GREEN, RISK}
    assert mesh.pid(RISK) == risk_pid
    assert {o.replica for o in outcomes if o.sent_s > retired_at} <= set(GREEN)
    # Every version is served by the green set now, the baseline too.
    assert predict(mesh, "v1").model_replica in GREEN


def test_a_draining_replica_gets_no_new_calls_and_keeps_running(
    mesh: Mesh, manager: RouteManager
) -> None:
    name, other = GREEN
    pid = mesh.pid(name)
    live = manager.live_spec()
    address = f"{live.host_of(name)}:{live.port_of(name)}"
    cluster = model_cluster("fraud", "v2", ZONE)

    def drain(names: list[str]) -> None:
        spec = manager.live_spec()
        fleet = spec.fleet.model_copy(update={"draining": names})
        manager.swap(spec, spec.model_copy(update={"fleet": fleet}), f"test: drain {names}")

    with steady_load(mesh) as load:
        drain([name])
        wait_until(lambda: not envoy_hosts(manager)[cluster][address].healthy, "Envoy drains it")
        drained_at = load.now_s()
        wait_until(
            lambda: sum(1 for o in list(load.outcomes) if o.sent_s > drained_at) >= 40,
            "calls while it drains",
        )
        undrained_at = load.now_s()
        drain([])
        wait_until(lambda: envoy_hosts(manager)[cluster][address].healthy, "it is back")
        back_at = load.now_s()
        wait_until(
            lambda: any(o.replica == name and o.sent_s > back_at for o in list(load.outcomes)),
            "a call answered by it again",
        )
        outcomes = finished(load)

    during = [o for o in outcomes if drained_at < o.sent_s < undrained_at]
    assert len(during) >= 40
    assert {o.replica for o in during} == {other}
    assert mesh.pid(name) == pid  # drained, not stopped


def test_a_rolling_update_replaces_each_replica_once_without_a_failed_call(
    mesh: Mesh, manager: RouteManager
) -> None:
    recorder = Recorder()
    old_pids = {name: mesh.pid(name) for name in GREEN}
    before = last_id(manager)
    with steady_load(mesh) as load:
        ending = run_rolling(context(manager, recorder, "v1", "v2"))
        outcomes = finished(load)

    assert ending.outcome == RolloutOutcome.PROMOTED, ending.reason
    new_pids = {name: mesh.pid(name) for name in GREEN}
    assert all(new_pids[n] != old_pids[n] for n in GREEN), (old_pids, new_pids)
    assert not any(alive(pid) for pid in old_pids.values())
    # Once each, one at a time, in order.
    replaced = [m.split(":", 2)[2] for m in recorder.names() if m.startswith(ROLLING_REPLACED)]
    assert replaced == GREEN
    replaced_at = fleet_status(mesh.state_dir, "model")
    generations = {n: s["generation"] for n, s in replaced_at.items()}
    # Only fraud's pool is replaced: risk's server keeps its process.
    assert generations == {**dict.fromkeys(GREEN, 1), RISK: 0}
    assert manager.live_spec().fleet.draining == []
    assert [e["after"]["models"]["fraud"]["traffic"] for e in weight_changes(manager, before)] == [
        {"v1": 100, "v2": 0}
    ]
    # Both replicas answered while the other was out.
    assert {o.replica for o in outcomes} == set(GREEN)


def test_a_rolling_update_stopped_between_replicas_leaves_none_draining(
    mesh: Mesh, manager: RouteManager
) -> None:
    recorder = Recorder()

    def stop_after_the_first() -> str | None:
        done = any(m.startswith(ROLLING_REPLACED) for m in recorder.names())
        return "paused by the operator" if done else None

    weights = dict(manager.live_spec().models["fraud"].traffic)
    with steady_load(mesh) as load:
        ending = run_rolling(
            context(manager, recorder, "v2", "v1", should_stop=stop_after_the_first)
        )
        finished(load)

    assert ending.outcome == RolloutOutcome.ROLLED_BACK
    assert ending.reason == f"stopped after {GREEN[0]}: paused by the operator"
    live = manager.live_spec()
    assert live.fleet.generations == {GREEN[0]: 2, GREEN[1]: 1}
    assert live.fleet.draining == []
    assert dict(live.models["fraud"].traffic) == weights  # the split never moved


def test_a_rolling_update_refuses_a_version_the_mesh_does_not_serve(
    manager: RouteManager,
) -> None:
    from servemesh.rollout.fleet import FleetError

    with pytest.raises(FleetError, match=r"version: model 'fraud' has no version 'v9'"):
        run_rolling(context(manager, Recorder(), "v9", "v1"))


def test_stopping_the_mesh_stops_every_replica_it_started(mesh: Mesh) -> None:
    pids = [mesh.pid(name) for name in GREEN]
    assert all(alive(pid) for pid in pids)
    mesh.stop()
    assert not any(alive(pid) for pid in pids)
    assert not (mesh.state_dir / "fleet-status.json").exists()
    with pytest.raises(grpc.RpcError):
        predict(mesh)
