"""The arithmetic of canary analysis on bucketed counts: a quantile as PromQL's
histogram_quantile computes it, the population stability index, and a Kolmogorov-Smirnov
distance. Pure functions of bucket bounds and per-bucket counts (not cumulative; the last
bound +inf), so every number the analysis prints can be checked by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from servemesh.observe.scrape import quantile as _cumulative_quantile

# An empty bin's share in PSI: ln(0) is undefined, and any small floor keeps a bin the
# other arm fills from dominating by more than ln(share / EPSILON).
PSI_EPSILON = 1e-4
# PSI is computed over at most this many bins, merged from the fine fixed buckets so none
# is nearly empty: close to the usual decile binning. Fewer, fuller bins
# keep the sampling noise of two identical distributions low (about (bins - 1) x
# (1/n_baseline + 1/n_canary)).
PSI_MAX_BINS = 10


def bucket_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float:
    """The q-quantile of per-bucket counts, interpolated linearly inside its bucket as
    PromQL's histogram_quantile does (one definition: servemesh.observe.scrape.quantile);
    NaN without observations."""
    cumulative: dict[float, float] = {}
    running = 0.0
    for bound, count in zip(bounds, counts, strict=True):
        running += count
        cumulative[bound] = running
    return _cumulative_quantile(q, cumulative)


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


def ks_distance(baseline: Sequence[float], canary: Sequence[float]) -> float:
    """The largest gap between the two arms' cumulative shares at any bucket bound: the
    Kolmogorov-Smirnov statistic as far as the buckets resolve it (a lower bound of the
    exact one). NaN when an arm is empty."""
    total_b, total_c = sum(baseline), sum(canary)
    if total_b <= 0 or total_c <= 0:
        return math.nan
    gap, cum_b, cum_c = 0.0, 0.0, 0.0
    for b, c in zip(baseline, canary, strict=True):
        cum_b += b
        cum_c += c
        gap = max(gap, abs(cum_b / total_b - cum_c / total_c))
    return gap


def count_above(threshold: float, bounds: Sequence[float], counts: Sequence[float]) -> float:
    """How many observations lie above `threshold`: every bucket above it whole, and the
    bucket it falls in by the same linear interpolation histogram_quantile assumes (the
    +inf bucket, which has no width, wholly when its lower bound is above)."""
    above = 0.0
    lower = 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if lower >= threshold:
            above += count
        elif bound > threshold and math.isfinite(bound):
            above += count * (bound - threshold) / (bound - lower)
        lower = bound
    return above


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): how likely `k` or more of `n` calls land in a tail
    that holds a share `p` of them. 1.0 at or below the expected count (only small values
    are ever judged); the terms above it fall fast, so the sum stops once they vanish."""
    if k <= n * p or n <= 0:
        return 1.0
    if k > n:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = 0.0
    for i in range(k, n + 1):
        term = math.exp(
            math.lgamma(n + 1)
            - math.lgamma(i + 1)
            - math.lgamma(n - i + 1)
            + i * log_p
            + (n - i) * log_q
        )
        total += term
        if term < total * 1e-12:
            break
    return min(1.0, total)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with `df` degrees of freedom (df >= 1), in closed form:
    for an even df a Poisson sum, for an odd one erfc plus a series."""
    if df < 1:
        raise ValueError(f"df must be at least 1, got {df}")
    if x <= 0:
        return 1.0
    half = x / 2
    if df % 2 == 0:
        term = total = math.exp(-half)
        for i in range(1, df // 2):
            term *= half / i
            total += term
        return min(1.0, total)
    total = math.erfc(math.sqrt(half))
    term = math.sqrt(half) * math.exp(-half) * 2 / math.sqrt(math.pi)
    for i in range(1, (df + 1) // 2):
        total += term
        term *= half / (i + 0.5)
    return min(1.0, total)


def psi_chance(result: Psi, baseline_n: float, canary_n: float) -> float:
    """How likely two samples of one distribution, of these sizes, show a PSI this large:
    PSI is the symmetrised KL divergence of the two arms' shares, and for samples of one
    distribution PSI x nb nc / (nb + nc) is about chi-square with (bins - 1) degrees of
    freedom (the two-sample chi-square statistic it approximates)."""
    if result.bins < 2 or baseline_n <= 0 or canary_n <= 0:
        return 1.0
    effective = baseline_n * canary_n / (baseline_n + canary_n)
    return chi2_sf(result.value * effective, result.bins - 1)
