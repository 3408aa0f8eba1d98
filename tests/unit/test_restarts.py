"""Crash-loop backoff (servemesh.procs.restarts), on a clock the test moves: no process,
no sleep."""

from __future__ import annotations

import pytest

from servemesh.procs.restarts import (
    ENVOY_RESTARTS,
    SERVICE_RESTARTS,
    RestartPolicy,
    Restarts,
)

NAME = "model-fraud-zone-a-0"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def restarts_on(clock: Clock, policy: RestartPolicy = SERVICE_RESTARTS) -> Restarts:
    restarts = Restarts(lambda name: policy, clock=clock)
    restarts.started(NAME)
    return restarts


def crash_and_restart(restarts: Restarts, clock: Clock, up_s: float, status: int = -9) -> float:
    """The process stays up `up_s`, crashes, and is started again once due; the wait."""
    clock.advance(up_s)
    delay = restarts.exited(NAME, status)
    clock.advance(delay)
    assert restarts.due(NAME)
    restarts.restarted(NAME)
    return delay


def test_the_wait_doubles_from_one_second_per_crash_in_a_row_up_to_the_cap() -> None:
    clock = Clock()
    restarts = restarts_on(clock)
    delays = [crash_and_restart(restarts, clock, up_s=2.0) for _ in range(8)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert restarts.record(NAME).restarts == 8
    assert restarts.crashes_in_a_row(NAME) == 8


def test_a_restart_is_not_due_before_its_wait_has_passed() -> None:
    clock = Clock()
    restarts = restarts_on(clock)
    crash_and_restart(restarts, clock, up_s=5.0)
    clock.advance(3.0)
    assert restarts.exited(NAME, -11) == 2.0  # the second crash in a row
    assert restarts.pending(NAME) and not restarts.due(NAME)
    clock.advance(1.999)
    assert not restarts.due(NAME)
    clock.advance(0.001)
    assert restarts.due(NAME)
    restarts.restarted(NAME)
    assert not restarts.pending(NAME) and not restarts.due(NAME)
    record = restarts.record(NAME)
    assert (record.restarts, record.last_exit) == (2, -11)


def test_a_stable_minute_up_makes_the_next_crash_a_first_crash_again() -> None:
    clock = Clock()
    restarts = restarts_on(clock)
    for _ in range(5):
        crash_and_restart(restarts, clock, up_s=1.0)
    assert restarts.crashes_in_a_row(NAME) == 5
    clock.advance(59.9)
    assert restarts.crashes_in_a_row(NAME) == 5  # not yet a stable minute
    clock.advance(0.1)
    assert restarts.crashes_in_a_row(NAME) == 0
    assert crash_and_restart(restarts, clock, up_s=0.0) == 1.0
    # The count of restarts is a history: it does not reset with the streak.
    assert restarts.record(NAME).restarts == 6


def test_just_short_of_a_stable_minute_keeps_the_streak() -> None:
    clock = Clock()
    restarts = restarts_on(clock)
    crash_and_restart(restarts, clock, up_s=1.0)
    assert crash_and_restart(restarts, clock, up_s=59.0) == 2.0


def test_a_deliberate_start_cancels_a_pending_restart_and_is_not_counted() -> None:
    clock = Clock()
    restarts = restarts_on(clock)
    clock.advance(1.0)
    restarts.exited(NAME, 1)
    restarts.started(NAME)  # restart() by a drill or an operator, before the backoff ran out
    clock.advance(10.0)
    assert not restarts.pending(NAME) and not restarts.due(NAME)
    assert restarts.record(NAME).restarts == 0
    assert restarts.record(NAME).last_exit == 1


def test_an_envoy_restarts_at_once_the_first_time_then_backs_off() -> None:
    clock = Clock()
    restarts = restarts_on(clock, ENVOY_RESTARTS)
    delays = [crash_and_restart(restarts, clock, up_s=0.5) for _ in range(7)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]


def test_the_policy_caps_a_long_streak_without_overflow() -> None:
    assert SERVICE_RESTARTS.delay_s(10_000) == SERVICE_RESTARTS.max_delay_s
    with pytest.raises(ValueError):
        SERVICE_RESTARTS.delay_s(0)


def test_forgetting_a_process_starts_its_history_anew() -> None:
    clock = Clock()
    restarts = restarts_on(clock)
    crash_and_restart(restarts, clock, up_s=1.0)
    restarts.forget(NAME)
    assert NAME not in restarts.snapshot()
    restarts.started(NAME)
    assert crash_and_restart(restarts, clock, up_s=1.0) == 1.0
    assert restarts.snapshot()[NAME].restarts == 1
