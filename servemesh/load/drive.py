"""The loads themselves: an open loop on a schedule, or a closed loop of N workers, against
one target, with events run on time beside them. Both return the run's `LoadRun`."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

from servemesh.load.outcome import Request, refused, timed
from servemesh.load.run import Event, EventRecord, LoadRun
from servemesh.load.schedule import ClosedLoop, OpenSchedule
from servemesh.load.target import Target

# How often an open loop that runs until stopped looks at its stop flag while it waits.
STOP_POLL_S = 0.05


async def open_loop(
    target: Target,
    schedule: OpenSchedule,
    *,
    events: Sequence[Event] = (),
    stop: threading.Event | None = None,
    max_outstanding: int | None = None,
    drain_s: float | None = None,
    run: LoadRun | None = None,
) -> LoadRun:
    """Send each request when the schedule says, whether or not earlier ones answered.

    Runs until the schedule ends or `stop` is set, then waits for the answers still out
    (at most `drain_s`, when given). `max_outstanding` bounds the calls in flight: a request
    due beyond it is recorded as CLIENT_OVERLOADED instead of sent. Pass `run` to read the
    outcomes from another thread while this runs (its origin is then time zero).
    """
    if schedule.count is None and stop is None:
        raise ValueError("a schedule without an end needs a stop event")
    run = run if run is not None else LoadRun()
    origin = run.origin
    async with target.open_channel() as channel:
        request = target.request(channel)
        outstanding: set[asyncio.Task[None]] = set()
        event_tasks = _start_events(events, run)

        async def one(index: int, due: float) -> None:
            run.outcomes.append(await timed(request, index, due=due, origin=origin))

        def ended(index: int) -> bool:
            return schedule.count is not None and index >= schedule.count

        index = 0
        while not ended(index) and not (stop is not None and stop.is_set()):
            # Everything due by now leaves now, in one go: timers fire late, and the
            # schedule must not slip by their lateness.
            now = time.perf_counter()
            while not ended(index) and origin + schedule.due_s(index) <= now:
                due = origin + schedule.due_s(index)
                if max_outstanding is not None and len(outstanding) >= max_outstanding:
                    run.outcomes.append(refused(index, due=due, origin=origin))
                else:
                    task = asyncio.create_task(one(index, due))
                    outstanding.add(task)
                    task.add_done_callback(outstanding.discard)
                index += 1
            run.scheduled = index
            if ended(index):
                break
            wait = max(0.0, origin + schedule.due_s(index) - time.perf_counter())
            # Always yield, so the calls just created get to leave; a stoppable loop also
            # wakes now and then to look at its flag.
            await asyncio.sleep(min(wait, STOP_POLL_S) if stop is not None else wait)
        stopped = stop is not None and stop.is_set()
        await _finish(outstanding, event_tasks, drain_s, cancel_events=stopped)
    return run


async def closed_loop(
    target: Target,
    schedule: ClosedLoop,
    *,
    events: Sequence[Event] = (),
    run: LoadRun | None = None,
) -> LoadRun:
    """`schedule.workers` callers sending back to back for `schedule.duration_s`; a request's
    latency counts from when its worker sent it (a closed loop has no schedule to be late
    for, which is why it cannot show a stall as latency: use an open loop for that)."""
    run = run if run is not None else LoadRun()
    origin = run.origin
    async with target.open_channel() as channel:
        request: Request = target.request(channel)
        until = origin + schedule.duration_s
        event_tasks = _start_events(events, run)

        async def worker(first: int) -> None:
            index = first
            while (now := time.perf_counter()) < until:
                run.scheduled += 1
                run.outcomes.append(await timed(request, index, due=now, origin=origin))
                index += schedule.workers

        await asyncio.gather(*(worker(w) for w in range(schedule.workers)))
        await _finish(set(), event_tasks, None, cancel_events=False)
    return run


def _start_events(events: Sequence[Event], run: LoadRun) -> list[asyncio.Task[None]]:
    loop = asyncio.get_running_loop()

    def perform(event: Event) -> None:
        record = EventRecord(event.name, run.now_s(), 0.0)
        try:
            record.result = event.action()
        except Exception as exc:  # recorded for the caller to assert on
            record.error = f"{type(exc).__name__}: {exc}"
        record.finished_s = run.now_s()
        run.events.append(record)

    async def on_time(event: Event) -> None:
        await asyncio.sleep(max(0.0, event.at_s - run.now_s()))
        await loop.run_in_executor(None, perform, event)

    return [asyncio.create_task(on_time(event)) for event in events]


async def _finish(
    outstanding: set[asyncio.Task[None]],
    event_tasks: list[asyncio.Task[None]],
    drain_s: float | None,
    *,
    cancel_events: bool,
) -> None:
    """Wait for the answers still out (every call carries a deadline) and the events; a
    stopped load drops the events that have not started."""
    if outstanding:
        _, late = await asyncio.wait(set(outstanding), timeout=drain_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)
    if cancel_events:
        for task in event_tasks:
            task.cancel()
    if event_tasks:
        await asyncio.gather(*event_tasks, return_exceptions=cancel_events)
