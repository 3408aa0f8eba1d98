"""The population stability index on bucketed counts: how far one sample's shares over a
set of bins moved from another's. Pure arithmetic on per-bin counts, so the canary analysis
(servemesh/rollout/analysis.py, two arms' score histograms) and feature drift
(servemesh/predlog/drift.py, live inputs against a reference) compute the same statistic.
It imports nothing of ours, so every layer may use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# An empty bin's share in PSI: ln(0) is undefined, and any small floor keeps a bin the
# other arm fills from dominating by more than ln(share / EPSILON).
PSI_EPSILON = 1e-4
# PSI is computed over at most this many bins, merged from the fine fixed buckets so none
# is nearly empty: close to the usual decile binning. Fewer, fuller bins
# keep the sampling noise of two identical distributions low (about (bins - 1) x
# (1/n_baseline + 1/n_canary)).
PSI_MAX_BINS = 10


@dataclass(frozen=True)
class Psi:
    value: float
    bins: int  # the merged bins it was computed over
    # Its expected value for two samples of one distribution, (bins - 1)(1/n1 + 1/n2):
    # below it, a PSI says nothing.
    noise: float


def merged_bins(baseline: Sequence[float], canary: Sequence[float], max_bins: int) -> list[int]:
    """Which fine buckets PSI groups into one bin: the thinnest bin (by the pooled share of
    both arms) joins its thinner neighbour until at most `max_bins` remain and none holds
    less than half of 1/max_bins. Returns the exclusive end index of each bin."""
    total_b, total_c = sum(baseline), sum(canary)
    pooled = [
        (b / total_b if total_b else 0.0) + (c / total_c if total_c else 0.0)
        for b, c in zip(baseline, canary, strict=True)
    ]
    floor = sum(pooled) / max_bins / 2
    bins = [[i + 1, share] for i, share in enumerate(pooled)]  # [end, share]
    while len(bins) > 1:
        thinnest = min(range(len(bins)), key=lambda i: bins[i][1])
        if len(bins) <= max_bins and bins[thinnest][1] >= floor:
            break
        if thinnest == 0:
            other = 1
        elif thinnest == len(bins) - 1:
            other = thinnest - 1
        else:
            before, after = thinnest - 1, thinnest + 1
            other = before if bins[before][1] <= bins[after][1] else after
        low, high = sorted((thinnest, other))
        bins[low : high + 1] = [[bins[high][0], bins[low][1] + bins[high][1]]]
    return [int(end) for end, _ in bins]


def psi(
    baseline: Sequence[float],
    canary: Sequence[float],
    *,
    max_bins: int = PSI_MAX_BINS,
    epsilon: float = PSI_EPSILON,
) -> Psi:
    """Population stability index of the canary's counts against the baseline's:
    sum over bins of (c - b) ln(c / b), b and c each arm's share of the bin (at least
    `epsilon`). 0 for identical shares; about 0.1 is a small shift, above 0.2 a large one."""
    if len(baseline) != len(canary):
        raise ValueError(f"bucket counts differ in length: {len(baseline)} vs {len(canary)}")
    total_b, total_c = sum(baseline), sum(canary)
    if total_b <= 0 or total_c <= 0:
        return Psi(math.nan, 0, math.inf)
    value, start = 0.0, 0
    ends = merged_bins(baseline, canary, max_bins)
    for end in ends:
        b = max(sum(baseline[start:end]) / total_b, epsilon)
        c = max(sum(canary[start:end]) / total_c, epsilon)
        value += (c - b) * math.log(c / b)
        start = end
    noise = (len(ends) - 1) * (1 / total_b + 1 / total_c)
    return Psi(value, len(ends), noise)
