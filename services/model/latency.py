"""Expected inference time per batch size, learned online from the batches the model runs."""

from __future__ import annotations

import bisect
from collections.abc import Mapping


class LatencyTable:
    """An EWMA of the seconds one model call takes, per batch size.

    Seeded with warm-up timings, updated after every successful batch. Sizes never seen are
    estimated from their neighbours: linearly between the nearest smaller and larger sizes,
    proportionally to rows above the largest (pessimistic: a deadline check should rather
    refuse a request it could have served than run one that cannot make it), and as the
    smallest known size below it.
    """

    def __init__(self, alpha: float = 0.2, seed: Mapping[int, float] | None = None) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._seconds: dict[int, float] = {}
        self._sizes: list[int] = []  # sorted keys of _seconds, for neighbour look-ups
        for size, seconds in (seed or {}).items():
            self._set(size, seconds)

    def _set(self, size: int, seconds: float) -> None:
        if size not in self._seconds:
            bisect.insort(self._sizes, size)
        self._seconds[size] = max(0.0, seconds)

    def seed(self, size: int, seconds: float) -> None:
        """Set the expected time of a size outright (a warm-up measurement)."""
        self._set(size, seconds)

    def observe(self, size: int, seconds: float) -> None:
        """Fold one measured batch into the average for its size."""
        previous = self._seconds.get(size)
        if previous is None:
            self._set(size, seconds)
        else:
            self._set(size, previous + self.alpha * (seconds - previous))

    def expected(self, size: int) -> float:
        """Seconds a batch of `size` rows is expected to take; 0.0 before anything is known."""
        known = self._seconds.get(size)
        if known is not None:
            return known
        if not self._sizes:
            return 0.0
        at = bisect.bisect_left(self._sizes, size)
        if at == 0:
            return self._seconds[self._sizes[0]]
        lower = self._sizes[at - 1]
        if at == len(self._sizes):
            return self._seconds[lower] * size / lower
        upper = self._sizes[at]
        low_s, high_s = self._seconds[lower], self._seconds[upper]
        return low_s + (high_s - low_s) * (size - lower) / (upper - lower)

    def snapshot(self) -> dict[int, float]:
        return dict(self._seconds)
