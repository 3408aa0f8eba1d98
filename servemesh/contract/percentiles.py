"""The one percentile in servemesh: nearest rank.

A drill's p99, a probe's p99, a benchmark's p99 and a trace hop's p90 are the same
statistic. Nearest rank returns a value some request really had, never an interpolation
between two. It imports nothing of ours, so every layer may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], pct: float) -> float:
    """Nearest-rank percentile, `pct` from 0 to 100: the smallest value with at least
    pct% of the values at or below it (p0 is the minimum, p100 the maximum). NaN for none."""
    if not 0 <= pct <= 100:
        raise ValueError(f"percentile: pct must be within [0, 100], got {pct}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]
