"""When requests leave: open-loop schedules fixed before the run, and the closed loop.

An open-loop schedule says when request i is due, computed from i alone, never from when
earlier requests answered or from when the client got round to sending them: a late send
does not push the ones after it back (that would hide a stall as a lower rate). A closed
loop has no schedule: each of N workers sends its next request when the last one answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class OpenSchedule(Protocol):
    """Request i is due `due_s(i)` seconds after the run's time zero; `count` requests in
    all, or None for a schedule that runs until stopped."""

    @property
    def count(self) -> int | None: ...

    def due_s(self, index: int) -> float: ...


@dataclass(frozen=True)
class FixedRate:
    """`rate_per_s` requests a second, evenly spaced, for `duration_s` (default: until
    stopped). Request i is due at i / rate_per_s."""

    rate_per_s: float
    duration_s: float = math.inf

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0 or math.isinf(self.rate_per_s):
            raise ValueError(f"rate_per_s must be positive and finite, got {self.rate_per_s}")
        if not self.duration_s >= 0:
            raise ValueError(f"duration_s must not be negative, got {self.duration_s}")

    @property
    def count(self) -> int | None:
        if math.isinf(self.duration_s):
            return None
        # Every request due in [0, duration_s); rounded first so that 9 s at 150/s is 1350,
        # not 1351 by a float's last bit.
        return math.ceil(round(self.duration_s * self.rate_per_s, 9))

    def due_s(self, index: int) -> float:
        return index / self.rate_per_s


@dataclass(frozen=True)
class SendTimes:
    """Requests due at the given offsets (seconds, not decreasing)."""

    times_s: tuple[float, ...]

    def __init__(self, times_s: Sequence[float]) -> None:
        times = tuple(float(t) for t in times_s)
        if any(t < 0 or math.isnan(t) for t in times):
            raise ValueError("send times must be non-negative")
        if any(b < a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError("send times must not decrease")
        object.__setattr__(self, "times_s", times)

    @property
    def count(self) -> int | None:
        return len(self.times_s)

    def due_s(self, index: int) -> float:
        return self.times_s[index]


@dataclass(frozen=True)
class ClosedLoop:
    """`workers` callers, each sending its next request as soon as its last one answered,
    for `duration_s`. Worker w sends requests w, w + workers, w + 2 * workers, ..."""

    workers: int
    duration_s: float

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if not 0 <= self.duration_s < math.inf:
            raise ValueError(f"duration_s must be finite and not negative, got {self.duration_s}")
