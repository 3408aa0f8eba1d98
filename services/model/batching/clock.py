"""Time for the batcher's decisions: read it, schedule a callback at it, wait until it.

The batcher never calls `time.monotonic()` or `loop.call_at()` itself; it asks its Clock, so
a test drives time by hand (ManualClock) instead of sleeping and hoping a timer fired.

| clock | `now()` | a timer fires |
| --- | --- | --- |
| MonotonicClock (default) | `time.monotonic()`, the loop's own clock | on the loop, when due |
| ManualClock (tests) | what the test moved it to (`advance`) | inside `advance`, in time order |

Deadlines handed to the batcher are read on the same clock (the servicer's come from
`time.monotonic()`, which is why the default is the monotonic clock).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class Timer(Protocol):
    """A scheduled callback that can still be called off (asyncio.TimerHandle is one)."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """What the batcher needs of time. `now` may be called from any thread; the rest only
    from the event loop."""

    def now(self) -> float:
        """Seconds on this clock's scale (deadlines use the same scale)."""
        ...

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Timer:
        """Call `callback(*args)` on the event loop once the clock reads `when`."""
        ...

    async def wait(self, event: asyncio.Event, until: float | None = None) -> None:
        """Return once `event` is set, or once the clock reads `until` (never, when None)."""
        ...


class MonotonicClock:
    """The real clock: `time.monotonic()`, which is also what asyncio's loop.time() reads."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Timer:
        return asyncio.get_running_loop().call_at(when, callback, *args)

    async def wait(self, event: asyncio.Event, until: float | None = None) -> None:
        if until is None:
            await event.wait()
            return
        timer = asyncio.get_running_loop().call_at(until, event.set)
        try:
            await event.wait()
        finally:
            timer.cancel()


MONOTONIC = MonotonicClock()


@dataclass(order=True)
class _ManualTimer:
    when: float
    seq: int
    callback: Callable[..., object] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(eq=False)
class _Sleeper:
    event: asyncio.Event
    until: float | None


class ManualClock:
    """A clock that stands still until the test moves it (`advance`, `advance_to`).

    Timers due by the new time fire inside `advance`, one by one in time order, each with
    the clock reading its own time. `parked()` tells the test when a task has blocked in
    `wait` and until when: the moment a batch loop has made its plan. Use it from the
    event loop's thread only (`now` excepted, which the model's worker thread reads).
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._timers: list[_ManualTimer] = []
        self._seq = itertools.count()
        self._sleepers: list[_Sleeper] = []
        self._changed = asyncio.Event()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Timer:
        timer = _ManualTimer(when, next(self._seq), callback, args)
        heapq.heappush(self._timers, timer)
        return timer

    async def wait(self, event: asyncio.Event, until: float | None = None) -> None:
        if until is not None and until <= self._now:
            return
        timer = self.call_at(until, event.set) if until is not None else None
        sleeper = _Sleeper(event, until)
        self._sleepers.append(sleeper)
        self._notify()
        try:
            await event.wait()
        finally:
            self._sleepers.remove(sleeper)
            if timer is not None:
                timer.cancel()
            self._notify()

    def advance(self, seconds: float) -> None:
        """Move the clock forward by `seconds`, firing every timer due on the way."""
        if seconds < 0:
            raise ValueError(f"a clock does not go back: advance({seconds})")
        self.advance_to(self._now + seconds)

    def advance_to(self, when: float) -> None:
        """Move the clock forward to `when`, firing every timer due on the way."""
        if when < self._now:
            raise ValueError(f"a clock does not go back: {when} is before {self._now}")
        while self._timers and self._timers[0].when <= when:
            timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, timer.when)
            timer.callback(*timer.args)
        self._now = when

    async def parked(self) -> float | None:
        """Wait until a task is blocked in `wait` with nothing yet waking it; the time it
        waits until (None: it waits for its event alone)."""
        while True:
            for sleeper in self._sleepers:
                if not sleeper.event.is_set():
                    return sleeper.until
            changed = self._changed
            await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
