"""How much of the mesh a `--through-mesh` batch run takes: as much as is idle, and less as
soon as online traffic needs it.

The model servers' batchers already queue a batch row behind every online one, but on a
small host the batch run's forward passes, its client and the Envoy hop all take CPU the
online path needs, so online latency rises with the batch run's concurrency however the
queues are ordered. The run cannot see online traffic, but it sees what that traffic does
to its own calls: a batch request waits behind online rows and for CPU, and its latency
rises above what an idle mesh gives it.

That is the problem a scavenger transport solves on a shared link, and the rule here is
LEDBAT's (RFC 6817): keep the lowest latency seen as the base, treat what is above it as
queueing delay, and move the window linearly toward a target queueing delay: up while below
it, down while above, halved at once when the delay passes twice the target. The window
counts requests in flight; below one, a single request is in flight and the run pauses
after each answer, so a window of 0.25 keeps the model servers busy for the run a quarter
of the time. An idle mesh gives the run its full window again within a few answers.

Pure logic with an injectable clock (`YieldingWindow`), and the asyncio gate that applies it
(`YieldingGate`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

# The target queueing delay: this share of the base latency, at least TARGET_MIN_S. A batch
# call's latency may double before the run gives way.
TARGET_SHARE = 1.0
TARGET_MIN_S = 0.002
# The smallest window: one request in flight a tenth of the time.
MIN_WINDOW = 0.1
# The base is the lowest latency over the last BASE_BUCKETS buckets of BASE_BUCKET_S each
# (LEDBAT keeps ten one-minute minima): old enough to remember an idle mesh through a long
# busy spell, young enough to follow a mesh that became slower for good (a replica gone).
BASE_BUCKET_S = 10.0
BASE_BUCKETS = 30


@dataclass(frozen=True)
class Answer:
    """What one answered batch request tells the window."""

    latency_s: float
    at_s: float  # when it was answered, on the window's clock


class YieldingWindow:
    """The batch run's window of requests in flight, from its requests' latencies."""

    def __init__(
        self, most: int, clock: Callable[[], float] = time.monotonic, *, fixed: bool = False
    ) -> None:
        """`fixed`: the window stays at `most` (a greedy run); latencies are still noted."""
        if most < 1:
            raise ValueError(f"most: {most} is not >= 1")
        self.most = most
        self.fixed = fixed
        self.clock = clock
        self.window = float(most)
        self._minima: deque[tuple[int, float]] = deque(maxlen=BASE_BUCKETS)
        self._last_halved_s = -math.inf

    @property
    def base_s(self) -> float | None:
        """The lowest latency remembered; None before the first answer."""
        return min((low for _, low in self._minima), default=None)

    @property
    def in_flight(self) -> int:
        """Requests allowed out at once (at least one)."""
        return max(1, math.floor(self.window))

    def gap_s(self, latency_s: float) -> float:
        """The pause after an answer: none at a window of one or more; below one, as long
        as makes the run's share of time `window`."""
        if self.window >= 1:
            return 0.0
        return latency_s * (1 / self.window - 1)

    def answered(self, latency_s: float) -> None:
        """Take one answer's latency: note it for the base, then move the window."""
        now = self.clock()
        bucket = int(now // BASE_BUCKET_S)
        if self._minima and self._minima[-1][0] == bucket:
            if latency_s < self._minima[-1][1]:
                self._minima[-1] = (bucket, latency_s)
        else:
            self._minima.append((bucket, latency_s))
        if self.fixed:
            return
        base = min(low for _, low in self._minima)
        target = max(TARGET_MIN_S, TARGET_SHARE * base)
        queueing = latency_s - base
        if queueing > 2 * target:
            self._halve(now, round_trip_s=latency_s)
            return
        off_target = (target - queueing) / target  # 1 at no queueing, < 0 above the target
        step = off_target / max(self.window, 1.0)
        self.window = min(float(self.most), max(MIN_WINDOW, self.window + step))

    def refused(self) -> None:
        """A request refused for load (a full queue, no replica just now): halve, as for a
        delay far over the target."""
        if not self.fixed:
            self._halve(self.clock(), round_trip_s=self.base_s or 0.0)

    def _halve(self, now: float, round_trip_s: float) -> None:
        """Halve the window, at most once per round trip: the answers (or refusals) of one
        round trip all carry the same news."""
        if now - self._last_halved_s >= round_trip_s:
            self.window = max(MIN_WINDOW, self.window / 2)
            self._last_halved_s = now


class YieldingGate:
    """At most `window.in_flight` requests of the run out at once, each answer moving the
    window and, below a window of one, followed by its pause."""

    def __init__(self, window: YieldingWindow) -> None:
        self.window = window
        self._out = 0
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one place for one request; its latency is what the block took."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._out < self.window.in_flight)
            self._out += 1
        started = self.window.clock()
        answered = False
        try:
            yield
            answered = True
        finally:
            latency = self.window.clock() - started
            gap = 0.0
            if answered:
                self.window.answered(latency)
                gap = self.window.gap_s(latency)
            try:
                if gap > 0:
                    await asyncio.sleep(gap)
            finally:
                async with self._changed:
                    self._out -= 1
                    self._changed.notify_all()
