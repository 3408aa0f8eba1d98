"""The scaler's decisions as pure functions of the policy, the signals and injected clocks:
in proportion to the worst signal, windows that ride out spikes, no flapping under a
square wave, cooldown, floors and bounds, and calendar floors that are local times (DST)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from servemesh.scaling.decide import PoolSignals, Stabilizer, decide, recommend
from servemesh.scaling.schedule import floor_at
from servemesh.spec.scaling_policy import PoolPolicy, ScalingSchedule, ScheduleFloor, front_targets

MONDAY_NOON = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def policy(**fields: object) -> PoolPolicy:
    base: dict[str, object] = {
        "min": 1,
        "max": 4,
        "step_up": 2,
        "up_window": "10s",
        "down_window": "60s",
        "cooldown": "30s",
    }
    return PoolPolicy.model_validate({**base, **fields})


def signals(replicas: int, p99_ms: float | None = 20.0, **rest: float) -> PoolSignals:
    return PoolSignals(replicas=replicas, p99_ms=p99_ms, queue_depth=0.0, cpu=0.1, **rest)


def test_the_worst_signal_sets_the_size_in_proportion_within_a_step() -> None:
    p = policy()
    assert recommend(p, signals(1, p99_ms=180.0)).replicas == 2  # 1.8x: ceil 2
    assert recommend(p, signals(2, p99_ms=180.0)).replicas == 4  # 2 x 1.8 = 3.6: 4
    assert recommend(p, signals(1, p99_ms=500.0)).replicas == 3  # 5x, but step_up 2
    queue = PoolSignals(replicas=2, p99_ms=50.0, queue_depth=20.0, cpu=0.2)
    found = recommend(p, queue)
    assert found.replicas == 4 and found.why == "queue_depth 20 > 8.00"
    assert recommend(p, signals(2, p99_ms=105.0)).replicas == 2  # within the tolerance


def test_shrinking_only_well_under_target_and_never_below_what_fits() -> None:
    p = policy(step_down=2)
    assert recommend(p, signals(2, p99_ms=60.0)).replicas == 2  # 0.6: not under 0.5
    assert recommend(p, signals(2, p99_ms=40.0)).replicas == 1  # 2 x 0.4 fits in 1
    # 4 replicas at 0.45 of target: 2 would run at 0.9 (fits), 1 at 1.8 (would not).
    assert recommend(p, signals(4, p99_ms=45.0)).replicas == 2
    idle = PoolSignals(replicas=3, p99_ms=None, queue_depth=0.0, cpu=0.0)
    assert recommend(p, idle).replicas == 1
    assert "idle" in recommend(policy(), PoolSignals(replicas=2)).why


def test_errors_ask_for_one_step_more() -> None:
    p = policy(target={"p99_ms": 100, "error_ratio": 0.01})
    found = recommend(p, PoolSignals(replicas=2, p99_ms=50.0, error_ratio=0.05))
    assert found.replicas == 3 and found.why.startswith("error_ratio 5.00%")


def test_a_breach_must_hold_the_whole_up_window_and_a_spike_is_ridden_out() -> None:
    p = policy()
    stable = Stabilizer()
    hot = signals(1, p99_ms=300.0)
    assert decide("zone-a", p, hot, stable, 0.0, MONDAY_NOON).held == "not yet 10s"
    assert decide("zone-a", p, hot, stable, 5.0, MONDAY_NOON).held == "not yet 10s"
    up = decide("zone-a", p, hot, stable, 10.0, MONDAY_NOON)
    assert (up.current, up.desired) == (1, 3)
    assert up.line() == "p99_ms 300 > 100 over 10s: model zone-a 1 -> 3"

    spiky = Stabilizer()
    decide("zone-b", p, hot, spiky, 0.0, MONDAY_NOON)
    decide("zone-b", p, signals(1), spiky, 5.0, MONDAY_NOON)  # the spike is gone
    assert not decide("zone-b", p, hot, spiky, 10.0, MONDAY_NOON).changes


def test_a_square_wave_of_load_makes_one_decision_each_way_not_one_per_edge() -> None:
    """Load flips every 20 s for 10 minutes (each half far above or far below target): the
    up window (10 s) lets each hot half through only after it held, the down window (60 s)
    never sees a whole cold minute, so the pool scales up once and stays there."""
    p = policy(up_window="25s", step_up=1)
    stable = Stabilizer()
    replicas, changes = 1, 0
    for tick in range(0, 600, 5):
        hot = (tick // 20) % 2 == 0
        found = decide(
            "zone-a",
            p,
            signals(replicas, p99_ms=300.0 if hot else 10.0),
            stable,
            float(tick),
            MONDAY_NOON,
        )
        if found.changes:
            replicas, changes = found.desired, changes + 1
            stable.changed(float(tick))
    assert (changes, replicas) == (0, 1)  # no hot half lasts the 25 s window: nothing moves

    p = policy(up_window="10s", step_up=1, max=2)
    stable, replicas, moves = Stabilizer(), 1, []
    for tick in range(0, 600, 5):
        hot = (tick // 20) % 2 == 0
        load = 300.0 / replicas if hot else 10.0
        found = decide(
            "zone-a", p, signals(replicas, p99_ms=load), stable, float(tick), MONDAY_NOON
        )
        if found.changes:
            moves.append((tick, found.current, found.desired))
            replicas = found.desired
            stable.changed(float(tick))
    assert moves == [(10, 1, 2)]  # up once, at the first hot half that held; never back down


def test_cooldown_holds_every_decision_after_a_change() -> None:
    p = policy(down_window="10s")
    stable = Stabilizer()
    stable.changed(0.0)
    cold = signals(3, p99_ms=5.0)
    for at in (0.0, 10.0, 20.0):
        assert decide("zone-a", p, cold, stable, at, MONDAY_NOON).held in ("cooldown",)
    assert decide("zone-a", p, cold, stable, 40.0, MONDAY_NOON).desired == 2


def test_floors_and_bounds_act_at_once() -> None:
    p = policy(min=2, max=3)
    below = decide("zone-a", p, signals(1), Stabilizer(), 0.0, MONDAY_NOON)
    assert (below.desired, below.reason) == (2, "min 2")
    above = decide("zone-a", p, signals(4, p99_ms=500.0), Stabilizer(), 0.0, MONDAY_NOON)
    assert (above.desired, above.reason) == (3, "max 3")


def test_a_schedule_floor_raises_the_minimum_in_its_window_only() -> None:
    weekdays = ["mon", "tue", "wed", "thu", "fri"]
    schedule = {
        "timezone": "Europe/Berlin",
        "floors": [{"days": weekdays, "from": "08:45", "to": "18:00", "min": 3}],
    }
    p = policy(schedule=schedule)
    # 12:00 UTC is 13:00 in Berlin in winter: inside the window.
    found = decide("zone-a", p, signals(1), Stabilizer(), 0.0, MONDAY_NOON)
    assert (found.desired, found.reason) == (3, "schedule floor 3 (08:45-18:00 Europe/Berlin)")
    # 17:30 UTC is 18:30 in Berlin: past it, so the floor is min again.
    evening = MONDAY_NOON.replace(hour=17, minute=30)
    assert decide("zone-a", p, signals(1), Stabilizer(), 0.0, evening).desired == 1
    saturday = MONDAY_NOON - timedelta(days=2)
    assert not decide("zone-a", p, signals(1), Stabilizer(), 0.0, saturday).changes


def test_floors_are_local_wall_times_across_dst_and_midnight() -> None:
    morning = ScheduleFloor.model_validate({"from": "08:45", "to": "09:15", "min": 2})
    schedule = ScalingSchedule(timezone="Europe/Berlin", floors=[morning])
    # Berlin is UTC+1 in winter, UTC+2 in summer: 08:50 local is 07:50 UTC, then 06:50 UTC.
    assert floor_at(schedule, datetime(2026, 1, 12, 7, 50, tzinfo=UTC))[0] == 2
    assert floor_at(schedule, datetime(2026, 7, 13, 6, 50, tzinfo=UTC))[0] == 2
    assert floor_at(schedule, datetime(2026, 7, 13, 7, 50, tzinfo=UTC))[0] == 0
    # The spring change (29 March 2026: 02:00 -> 03:00): a floor from 02:30 holds at 03:00.
    night = ScheduleFloor.model_validate({"from": "02:30", "to": "04:00", "min": 2})
    spring = ScalingSchedule(timezone="Europe/Berlin", floors=[night])
    assert floor_at(spring, datetime(2026, 3, 29, 1, 0, tzinfo=UTC))[0] == 2  # 03:00 CEST
    # Past midnight: friday 22:00 -> 06:00 holds early saturday, not early friday.
    late = ScheduleFloor.model_validate({"days": ["fri"], "from": "22:00", "to": "06:00", "min": 4})
    weekend = ScalingSchedule(floors=[late])
    assert floor_at(weekend, datetime(2026, 12, 5, 3, 0, tzinfo=UTC))[0] == 4  # saturday 03:00
    assert floor_at(weekend, datetime(2026, 12, 4, 3, 0, tzinfo=UTC))[0] == 0  # friday 03:00
    assert floor_at(weekend, datetime(2026, 12, 4, 23, 0, tzinfo=UTC))[0] == 4  # friday 23:00


def test_a_gateway_pool_scales_on_calls_in_flight_and_says_which_pool() -> None:
    """The gateways' default targets: calls in flight and CPU, no p99 (theirs holds the
    feature and model calls they wait for); the decision's line names the pool."""
    p = PoolPolicy(up_window="0s", target=front_targets())
    busy = PoolSignals(replicas=1, p99_ms=900.0, cpu=0.2, in_flight=60.0)
    assert recommend(p, busy).why == "in_flight 60 > 32"
    up = replace(decide("zone-a", p, busy, Stabilizer(), 0.0, MONDAY_NOON), pool="gateway")
    assert (up.current, up.desired) == (1, 2)
    assert up.line() == "in_flight 60 > 32 over 0s: gateway zone-a 1 -> 2"
    # A slow Predict alone (the model's time) asks for no more gateways.
    slow = PoolSignals(replicas=1, p99_ms=900.0, cpu=0.2, in_flight=4.0)
    assert recommend(p, slow).replicas == 1
