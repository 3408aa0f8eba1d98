"""The batcher's clocks: the manual one the tests drive, and the real one it replaces."""

from __future__ import annotations

import asyncio

import pytest

from servemesh.services.model.batching import MONOTONIC, ManualClock

pytestmark = pytest.mark.timeout(60)


def test_manual_clock_fires_due_timers_in_time_order_each_at_its_own_time() -> None:
    clock = ManualClock(start=5.0)
    fired: list[tuple[str, float]] = []
    clock.call_at(5.3, lambda: fired.append(("late", clock.now())))
    clock.call_at(5.1, lambda name: fired.append((name, clock.now())), "early")
    cancelled = clock.call_at(5.2, lambda: fired.append(("cancelled", clock.now())))
    clock.call_at(9.0, lambda: fired.append(("not yet", clock.now())))
    cancelled.cancel()
    clock.advance(0.5)
    assert fired == [("early", 5.1), ("late", 5.3)]
    assert clock.now() == 5.5
    with pytest.raises(ValueError, match="does not go back"):
        clock.advance_to(5.0)


async def test_manual_clock_tells_when_a_task_waits_and_until_when() -> None:
    clock = ManualClock()
    event = asyncio.Event()
    waiter = asyncio.create_task(clock.wait(event, until=0.25))
    assert await clock.parked() == 0.25
    clock.advance_to(0.2)
    assert not waiter.done() and await clock.parked() == 0.25  # still waiting
    clock.advance_to(0.25)
    await waiter  # woken by its time
    assert event.is_set()  # how the clock woke it
    other = asyncio.Event()
    forever = asyncio.create_task(clock.wait(other))
    assert await clock.parked() is None  # waits for its event alone
    other.set()
    await forever


async def test_monotonic_clock_is_the_event_loops_clock() -> None:
    loop = asyncio.get_running_loop()
    before = loop.time()
    now = MONOTONIC.now()
    assert before <= now <= loop.time()
    fired = loop.create_future()
    MONOTONIC.call_at(now, fired.set_result, "due")  # due already: the next loop pass
    assert await fired == "due"
    await MONOTONIC.wait(asyncio.Event(), until=now)  # returns once the time has come
