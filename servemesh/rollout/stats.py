"""The arithmetic of canary analysis on bucketed counts: a quantile as PromQL's
histogram_quantile computes it, the population stability index (servemesh/contract/psi.py,
which feature drift computes too), and a Kolmogorov-Smirnov distance. Pure functions of
bucket bounds and per-bucket counts (not cumulative; the last bound +inf), so every number
the analysis prints can be checked by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from servemesh.contract.psi import PSI_EPSILON, PSI_MAX_BINS, Psi, merged_bins, psi
from servemesh.observe.scrape import quantile as _cumulative_quantile

__all__ = [
    "PSI_EPSILON",
    "PSI_MAX_BINS",
    "Psi",
    "binomial_tail",
    "bucket_quantile",
    "chi2_sf",
    "count_above",
    "ks_distance",
    "merged_bins",
    "psi",
    "psi_chance",
]


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
