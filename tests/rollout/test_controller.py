"""The controller's state machine against a pretend mesh (tests/rollout/fakes.py): which
routes it sets and when, what it records, how each rollout ends. Pure and fast: the clock
moves only when the controller sleeps."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from servemesh.rollout.controller import ControllerError, StartRequest
from servemesh.rollout.types import Ending, Outcome
from servemesh.state.rollouts import StateStore
from tests.rollout.fakes import Arm, Crash, Gates, World, controller, short_plan

FULL = (None, 1, 5, 25, 50, 100)


def weights_set(world: World) -> list[dict[str, int]]:
    return [c[2] for c in world.changes if c[1] == "weights"]


def test_a_good_version_goes_from_shadow_to_full_and_is_promoted(tmp_path: Path) -> None:
    world = World()
    lines: list[str] = []
    ending = controller(tmp_path, world, lines=lines).start("fraud", "v2", short_plan(*FULL))
    assert ending.outcome == Outcome.PROMOTED, ending
    assert world.changes[0][1:] == ("shadow", "v2")
    assert world.changes[1][1:] == ("shadow", None)  # off before the first weight step
    assert weights_set(world) == [
        {"v1": 99, "v2": 1},
        {"v1": 95, "v2": 5},
        {"v1": 75, "v2": 25},
        {"v1": 50, "v2": 50},
        {"v1": 0, "v2": 100},
    ]
    state = StateStore(tmp_path).load("fraud")
    assert state is not None and state.status == "promoted" and not state.active
    assert state.weights == {"v1": 0, "v2": 100}
    events = [e["event"] for e in StateStore(tmp_path).history("fraud")]
    assert events == ["started"] + ["step"] * 6 + ["promoted"]
    # One line per step change and per check result.
    assert sum(line.startswith("step ") and "): " in line for line in lines) == 6
    assert any("error_ratio pass" in line for line in lines)


def test_steps_wait_for_their_dwell_and_their_requests(tmp_path: Path) -> None:
    # 10 calls/s and 1%: the 1% step needs 20 canary calls, i.e. 20 s, not its 2 s dwell.
    world = World(rate_per_s=10)
    plan = short_plan(1, 100, min_requests=20)
    ending = controller(tmp_path, world).start("fraud", "v2", plan)
    assert ending.outcome == Outcome.PROMOTED
    times = [c[0] for c in world.changes]
    assert times[1] - times[0] >= 200  # 20 canary calls at 0.1 call/s
    assert times[1] - times[0] <= 201


def test_a_failing_canary_is_rolled_back_within_one_interval_naming_the_check(
    tmp_path: Path,
) -> None:
    # 1,000 calls/s: the 1% arm has its 10 samples after one interval.
    world = World(rate_per_s=1000)
    lines: list[str] = []
    world.arms["v2"] = Arm(error_ratio=0.30)
    plan = short_plan(1, 5, 100)
    ending = controller(tmp_path, world, lines=lines).start("fraud", "v2", plan)
    assert ending.outcome == Outcome.ROLLED_BACK
    assert "error_ratio fail" in ending.reason and "step 1%" in ending.reason
    (first, back) = weights_set(world)
    assert first == {"v1": 99, "v2": 1} and back == {"v1": 100, "v2": 0}
    # The first bad step's first judgement: one analysis interval after it began.
    assert world.changes[-1][0] - world.changes[0][0] == pytest.approx(1.0)
    state = StateStore(tmp_path).load("fraud")
    assert state is not None and state.status == "rolled_back"
    assert state.reason == ending.reason
    assert lines[-1].startswith("rolling back: step 1%: error_ratio fail")


def test_a_psi_fail_that_the_next_look_does_not_repeat_rolls_nothing_back(
    tmp_path: Path,
) -> None:
    # One look's chance shift: a wait that says so, then the step goes on and promotes.
    world = World(rate_per_s=1000, psi_verdicts=["fail", "pass", "pass", "pass"])
    lines: list[str] = []
    ending = controller(tmp_path, world, lines=lines).start("fraud", "v2", short_plan(50, 100))
    assert ending.outcome == Outcome.PROMOTED, ending.reason
    assert any("psi wait: PSI scripted fail; to confirm at the next look" in x for x in lines)


def test_a_psi_fail_confirmed_by_the_next_look_rolls_back(tmp_path: Path) -> None:
    world = World(rate_per_s=1000, psi_verdicts=["fail", "fail"])
    ending = controller(tmp_path, world).start("fraud", "v2", short_plan(50, 100))
    assert ending.outcome == Outcome.ROLLED_BACK
    assert ending.reason.startswith("step 50%: psi fail: PSI scripted fail"), ending.reason
    # Judged once an interval: the second look (the second fail) decided.
    assert world.changes[-1][0] - world.changes[0][0] == pytest.approx(2.0)


def test_a_slow_canary_fails_its_p99_check(tmp_path: Path) -> None:
    world = World()
    world.arms["v2"] = Arm(p99_ms=110.0)
    ending = controller(tmp_path, world).start("fraud", "v2", short_plan(None, 1, 100))
    assert ending.outcome == Outcome.ROLLED_BACK
    assert ending.reason.startswith("step shadow: p99 fail")
    assert world.shadow is None and world.weights == {"v1": 100, "v2": 0}


def test_a_canary_slow_only_right_after_its_route_change_is_promoted(tmp_path: Path) -> None:
    # Its first calls pay for the route change (new connections, first calls of the changed
    # model); from the second interval on it is as fast as the baseline.
    world = World(rate_per_s=1000)
    world.arms["v2"] = Arm(p99_ms=110.0)

    def warm_after_one_interval(w: World) -> None:
        changed_at = max((t for t, kind, _ in w.changes if kind == "weights"), default=None)
        if changed_at is not None and w.t - changed_at >= 1.0:
            w.arms["v2"].p99_ms = 10.0

    world.on_sleep.append(warm_after_one_interval)
    lines: list[str] = []
    ending = controller(tmp_path, world, lines=lines).start("fraud", "v2", short_plan(1, 100))
    assert ending.outcome == Outcome.PROMOTED, ending.reason
    assert any("p99 wait: (settling after the route change)" in line for line in lines)


def test_a_canary_slow_throughout_a_split_step_fails_p99_at_its_second_judgement(
    tmp_path: Path,
) -> None:
    world = World(rate_per_s=1000)
    world.arms["v2"] = Arm(p99_ms=110.0)
    ending = controller(tmp_path, world).start("fraud", "v2", short_plan(1, 100))
    assert ending.outcome == Outcome.ROLLED_BACK
    assert ending.reason.startswith("step 1%: p99 fail")
    # One interval settles, the next one judges.
    assert world.changes[-1][0] - world.changes[0][0] == pytest.approx(2.0)


def test_a_blocking_checklist_item_refuses_and_touches_no_route(tmp_path: Path) -> None:
    world, gates = World(), Gates(failing={"freeze"})
    ending = controller(tmp_path, world, gates).start("fraud", "v2", short_plan(*FULL))
    assert ending.outcome == Outcome.REFUSED
    assert "freeze: freeze failed" in ending.reason
    assert world.changes == []
    state = StateStore(tmp_path).load("fraud")
    assert state is not None and state.status == "refused"
    assert [e["event"] for e in StateStore(tmp_path).history()] == ["refused"]


def test_an_override_lets_an_item_through_and_is_recorded_with_its_reason(
    tmp_path: Path,
) -> None:
    world, gates = World(), Gates(failing={"freeze"})
    ending = controller(tmp_path, world, gates).start(
        "fraud", "v2", short_plan(1, 100), overrides={"freeze": "hotfix for INC-42"}
    )
    assert ending.outcome == Outcome.PROMOTED
    history = StateStore(tmp_path).history("fraud")
    assert history[0]["overrides"] == {"freeze": "hotfix for INC-42"}
    (override,) = [e for e in history if e["event"] == "override"]
    assert override["item"] == "freeze" and override["reason"] == "hotfix for INC-42"


def test_an_override_of_an_unknown_item_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ControllerError, match="--override fridge: no such checklist item"):
        controller(tmp_path, World()).start(
            "fraud", "v2", short_plan(1, 100), overrides={"fridge": "why not"}
        )


def test_each_override_needs_its_own_reason() -> None:
    with pytest.raises(ControllerError, match="each needs its own --reason"):
        StartRequest.build("fraud", "v2", short_plan(1, 100), None, ["freeze", "budget"], ["x"])
    with pytest.raises(ControllerError, match="--reason for --override freeze"):
        StartRequest.build("fraud", "v2", short_plan(1, 100), None, ["freeze"], ["  "])


def test_the_checklist_on_shadow_traffic_can_refuse_after_the_shadow_step(
    tmp_path: Path,
) -> None:
    world, gates = World(), Gates(shadow_failing={"distribution"})
    ending = controller(tmp_path, world, gates).start("fraud", "v2", short_plan(None, 1, 100))
    assert ending.outcome == Outcome.REFUSED
    assert "distribution: distribution failed" in ending.reason
    assert world.shadow is None and weights_set(world) == []
    # It was judged on the shadow step's own calls: both arms got every call for 2 s.
    assert gates.calls == ["preflight", "after_shadow 200"]


def test_shadow_only_runs_the_shadow_step_and_turns_it_off(tmp_path: Path) -> None:
    world = World()
    plan = short_plan(*FULL).model_copy(update={"strategy": "shadow-only"})
    ending = controller(tmp_path, world).start("fraud", "v2", plan)
    assert ending.outcome == Outcome.PROMOTED
    assert [c[1:] for c in world.changes] == [("shadow", "v2"), ("shadow", None)]


def test_shadow_only_needs_a_shadow_step_and_says_so_before_recording(tmp_path: Path) -> None:
    plan = short_plan(25, 100).model_copy(update={"strategy": "shadow-only"})
    with pytest.raises(ControllerError, match="shadow-only: the plan has no shadow step"):
        controller(tmp_path, World()).start("fraud", "v2", plan)
    assert StateStore(tmp_path).load("fraud") is None


def test_a_second_start_is_refused_while_a_controller_is_alive(tmp_path: Path) -> None:
    world = World()
    store = StateStore(tmp_path)
    refused: list[Ending] = []

    def second_start(w: World) -> None:
        if not refused:
            refused.append(controller(tmp_path, w).start("fraud", "v2", short_plan(1, 100)))

    world.on_sleep.append(second_start)
    ending = controller(tmp_path, world).start("fraud", "v2", short_plan(1, 100))
    assert ending.outcome == Outcome.PROMOTED
    assert refused[0].outcome == Outcome.REFUSED
    assert "already under way" in refused[0].reason
    assert not store.alive("fraud")  # the lock went with the controller


def crash_at_step(weight: int) -> Any:
    def hook(w: World) -> None:
        if w.weights.get("v2") == weight:
            raise Crash()

    return hook


def test_a_killed_controller_leaves_its_step_and_resume_finishes_from_there(
    tmp_path: Path,
) -> None:
    world = World()
    world.on_sleep.append(crash_at_step(25))
    with pytest.raises(Crash):
        controller(tmp_path, world).start("fraud", "v2", short_plan(*FULL))
    store = StateStore(tmp_path)
    state = store.load("fraud")
    assert state is not None and state.active and state.step_label == "25%"
    assert not store.alive("fraud")
    # A second start is refused: the rollout is recorded and nobody drives it.
    refused = controller(tmp_path, world).start("fraud", "v2", short_plan(*FULL))
    assert refused.outcome == Outcome.REFUSED and "rollout resume fraud" in refused.reason
    world.on_sleep.clear()
    before = len(world.changes)
    ending = controller(tmp_path, world).resume("fraud")
    assert ending is not None and ending.outcome == Outcome.PROMOTED
    # It re-applied the recorded step, then went on; never back to an earlier one.
    assert [c[2] for c in world.changes[before:]] == [
        {"v1": 75, "v2": 25},
        {"v1": 50, "v2": 50},
        {"v1": 0, "v2": 100},
    ]
    assert "controller" in [e["event"] for e in store.history("fraud")]


def test_a_controller_killed_between_recording_a_step_and_applying_it(tmp_path: Path) -> None:
    world = World(crash_before=50)
    with pytest.raises(Crash):
        controller(tmp_path, world).start("fraud", "v2", short_plan(*FULL))
    state = StateStore(tmp_path).load("fraud")
    assert state is not None and state.step_label == "50%" and not state.step_applied
    # What Envoy serves, and the state says so: the step before.
    assert state.weights == {"v1": 75, "v2": 25} == world.weights
    world.crash_before = None
    ending = controller(tmp_path, world).resume("fraud")
    assert ending is not None and ending.outcome == Outcome.PROMOTED
    assert weights_set(world)[-2:] == [{"v1": 50, "v2": 50}, {"v1": 0, "v2": 100}]


def test_a_rollout_left_past_its_deadline_is_rolled_back_by_the_next_look(
    tmp_path: Path,
) -> None:
    world = World()
    world.on_sleep.append(crash_at_step(5))
    with pytest.raises(Crash):
        controller(tmp_path, world).start("fraud", "v2", short_plan(*FULL))
    world.on_sleep.clear()
    ctl = controller(tmp_path, world)
    assert ctl.expire_if_due("fraud") is None  # not yet: the deadline is 10 min
    world.t += 11 * 60
    state = ctl.expire_if_due("fraud")
    assert state is not None and state.status == "rolled_back"
    assert state.reason.startswith("deadline: the rollout was left without a controller")
    assert world.weights == {"v1": 100, "v2": 0}
    # ... and a new start may go ahead.
    assert ctl.start("fraud", "v2", short_plan(1, 100)).outcome == Outcome.PROMOTED


def test_pause_holds_the_step_and_resume_lets_it_go_on(tmp_path: Path) -> None:
    world = World()
    lines: list[str] = []
    ctl = controller(tmp_path, world, lines=lines)
    paused_at: list[float] = []

    def operator(w: World) -> None:
        state = StateStore(tmp_path).load("fraud")
        assert state is not None
        if state.step_label == "5%" and not paused_at:
            ctl.request("fraud", "pause", "looking at a dashboard")
            paused_at.append(w.t)
        elif paused_at and w.t - paused_at[0] >= 30 and state.pause is not None:
            assert ctl.resume("fraud") is None  # the controller is alive: it goes on

    world.on_sleep.append(operator)
    ending = ctl.start("fraud", "v2", short_plan(*FULL))
    assert ending.outcome == Outcome.PROMOTED
    held = [t for t, kind, w in world.changes if kind == "weights" and w["v2"] == 25]
    assert held[0] - paused_at[0] >= 30  # 5% held while paused, well past its 2 s dwell
    assert any("held: paused by" in line for line in lines)
    events = [e["event"] for e in StateStore(tmp_path).history("fraud")]
    assert "pause requested" in events and "resumed" in events


def test_abort_rolls_back_at_the_next_interval_with_who_and_why(tmp_path: Path) -> None:
    world = World()
    ctl = controller(tmp_path, world)

    def operator(w: World) -> None:
        if w.weights.get("v2") == 25:
            state = StateStore(tmp_path).load("fraud")
            if state is not None and state.abort is None:
                ctl.request("fraud", "abort", "customer complaints")

    world.on_sleep.append(operator)
    ending = ctl.start("fraud", "v2", short_plan(*FULL))
    assert ending.outcome == Outcome.ROLLED_BACK
    assert "aborted by" in ending.reason and "customer complaints" in ending.reason
    assert world.weights == {"v1": 100, "v2": 0}
    state = StateStore(tmp_path).load("fraud")
    assert state is not None and state.status == "aborted"


def test_abort_of_a_dead_controllers_rollout_is_done_by_the_command_itself(
    tmp_path: Path,
) -> None:
    world = World()
    world.on_sleep.append(crash_at_step(5))
    with pytest.raises(Crash):
        controller(tmp_path, world).start("fraud", "v2", short_plan(*FULL))
    world.on_sleep.clear()
    ctl = controller(tmp_path, world)
    ctl.request("fraud", "abort", "abandoned")
    ending = ctl.take_over("fraud")
    assert ending is not None and ending.outcome == Outcome.ROLLED_BACK
    assert world.weights == {"v1": 100, "v2": 0}


def test_promote_skips_the_remaining_steps(tmp_path: Path) -> None:
    world = World()
    ctl = controller(tmp_path, world)

    def operator(w: World) -> None:
        state = StateStore(tmp_path).load("fraud")
        if w.weights.get("v2") == 5 and state is not None and state.promote is None:
            ctl.request("fraud", "promote", "looks fine")

    world.on_sleep.append(operator)
    ending = ctl.start("fraud", "v2", short_plan(*FULL))
    assert ending.outcome == Outcome.PROMOTED and "promoted by" in ending.reason
    assert weights_set(world)[-2:] == [{"v1": 95, "v2": 5}, {"v1": 0, "v2": 100}]


def test_the_full_step_is_judged_against_the_baselines_last_window(tmp_path: Path) -> None:
    # The baseline answers nobody at 100%: a canary that turns bad only there is still
    # compared with what the baseline did at 50%, and rolled back.
    world = World()

    def turns_bad(w: World) -> None:
        if w.weights.get("v2") == 100:
            w.arms["v2"] = Arm(error_ratio=0.05)

    world.on_sleep.append(turns_bad)
    ending = controller(tmp_path, world).start("fraud", "v2", short_plan(50, 100))
    assert ending.outcome == Outcome.ROLLED_BACK
    assert ending.reason.startswith("step 100%: error_ratio fail")
    state = StateStore(tmp_path).load("fraud")
    assert state is not None and state.reference_baseline is not None
    assert state.reference_baseline.version == "v1"


def test_a_busy_change_lock_is_waited_out(tmp_path: Path) -> None:
    world = World(busy_changes=3)
    ending = controller(tmp_path, world).start("fraud", "v2", short_plan(1, 100))
    assert ending.outcome == Outcome.PROMOTED
    assert weights_set(world)[0] == {"v1": 99, "v2": 1}


def test_bad_model_version_and_split_are_errors_naming_them(tmp_path: Path) -> None:
    ctl = controller(tmp_path, World())
    with pytest.raises(ControllerError, match="model 'wine' is not served"):
        ctl.start("wine", "v2", short_plan(1, 100))
    with pytest.raises(ControllerError, match="version 'v9' of 'fraud' is not in the running"):
        ctl.start("fraud", "v9", short_plan(1, 100))
    split = World(weights={"v1": 90, "v2": 10})
    with pytest.raises(ControllerError, match=r"split \(v1=90 v2=10\)"):
        controller(tmp_path, split).start("fraud", "v2", short_plan(1, 100))


def test_a_fleet_strategy_gets_its_context_and_its_ending_is_recorded(tmp_path: Path) -> None:
    world = World()
    seen: dict[str, Any] = {}

    def run_blue_green(ctx: Any) -> Ending:
        seen["ctx"] = ctx
        ctx.record("green-warm", {"replicas": 2})
        assert ctx.should_stop() is None
        return Ending(Outcome.PROMOTED, "switched to green")

    fleet = SimpleNamespace(
        StrategyContext=lambda **kw: SimpleNamespace(**kw), run_blue_green=run_blue_green
    )
    ctl = controller(tmp_path, world)
    ctl.parts.fleet = fleet
    plan = short_plan(1, 100).model_copy(update={"strategy": "blue-green"})
    ending = ctl.start("fraud", "v2", plan)
    assert ending.outcome == Outcome.PROMOTED
    ctx = seen["ctx"]
    assert (ctx.model, ctx.version, ctx.baseline, ctx.resume_from) == ("fraud", "v2", "v1", None)
    state = StateStore(tmp_path).load("fraud")
    assert state is not None and state.status == "promoted"
    assert state.marker == "green-warm" and state.marker_data == {"replicas": 2}
    assert state.step_label == "green-warm"  # what `status` shows for a fleet strategy


def test_the_state_file_is_whole_json_and_history_keeps_every_rollout(tmp_path: Path) -> None:
    world = World()
    controller(tmp_path, world).start("fraud", "v2", short_plan(1, 100))
    # v2 took 100%: rolling v1 out again is a rollout like any other, v2 its baseline.
    controller(tmp_path, world).start("fraud", "v1", short_plan(1, 100))
    store = StateStore(tmp_path)
    state = json.loads(store.state_path("fraud").read_text())
    assert (state["version"], state["baseline"], state["status"]) == ("v1", "v2", "promoted")
    started = [e for e in store.history("fraud") if e["event"] == "started"]
    assert [e["version"] for e in started] == ["v2", "v1"]
    assert len({e["rollout"] for e in started}) == 2
    assert not list(store.root.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_a_recorded_window_keeps_its_infinite_last_bound(tmp_path: Path) -> None:
    import math

    from servemesh.rollout.state import arm_of, window_record
    from servemesh.rollout.types import ArmWindow

    arm = ArmWindow("v1", 10, 1, (0.005, math.inf), (9, 1), (0.5, math.inf), (4, 6))
    world = World()
    controller(tmp_path, world).start("fraud", "v2", short_plan(1, 100))
    store = StateStore(tmp_path)
    store.update("fraud", lambda s: s.model_copy(update={"reference_baseline": window_record(arm)}))
    state = store.load("fraud")
    assert state is not None and state.reference_baseline is not None
    assert arm_of(state.reference_baseline) == arm


def test_a_fleet_strategy_watches_the_new_version_with_the_controllers_analysis(
    tmp_path: Path,
) -> None:
    import dataclasses

    @dataclasses.dataclass
    class Context:
        manager: Any
        spec: Any
        model: str
        version: str
        baseline: str
        plan: Any
        say: Any
        record: Any
        resume_from: str | None
        should_stop: Any
        watch: Any = None

    def run_blue_green(ctx: Context) -> Ending:
        ctx.manager.sleep(5)  # the baseline's traffic before the switch: the reference
        ctx.manager.set_weights(ctx.model, {ctx.version: 100})
        verdict = ctx.watch()
        if verdict is not None:
            ctx.manager.set_weights(ctx.model, {ctx.baseline: 100})
            return verdict
        return Ending(Outcome.PROMOTED, "switched")

    fleet = SimpleNamespace(StrategyContext=Context, run_blue_green=run_blue_green)
    plan = short_plan(100).model_copy(update={"strategy": "blue-green"})
    good = controller(tmp_path / "good", World())
    good.parts.fleet = fleet
    assert good.start("fraud", "v2", plan).outcome == Outcome.PROMOTED
    bad_world = World()
    bad_world.arms["v2"] = Arm(error_ratio=0.2)
    bad = controller(tmp_path / "bad", bad_world)
    bad.parts.fleet = fleet
    ending = bad.start("fraud", "v2", plan)
    assert ending.outcome == Outcome.ROLLED_BACK
    assert ending.reason.startswith("blue-green: error_ratio fail")
    assert bad_world.weights == {"v1": 100, "v2": 0}
    state = StateStore(tmp_path / "bad").load("fraud")
    assert state is not None and state.status == "rolled_back"
