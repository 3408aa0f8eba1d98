"""One /metrics endpoint as samples, and the arithmetic `servemesh top` does on them when
no Prometheus runs: sums over labels, counter deltas, quantiles from histogram buckets."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse(text: str, extra: Mapping[str, str] | None = None) -> list[Sample]:
    """Prometheus text as samples, each with `extra` labels added (a target's labels)."""
    found = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.append(Sample(s.name, {**s.labels, **(extra or {})}, float(s.value)))
    return found


def scrape(
    address: str,
    path: str = "/metrics",
    timeout_s: float = 2.0,
    extra: Mapping[str, str] | None = None,
) -> list[Sample]:
    """GET http://address/path, parsed."""
    with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout_s) as reply:
        return parse(reply.read().decode(), extra)


def sample(samples: Iterable[Sample], name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of `name` over the samples whose labels include `labels` (0 when none)."""
    wanted = (labels or {}).items()
    return sum(s.value for s in samples if s.name == name and wanted <= s.labels.items())


Where = Callable[[Mapping[str, str]], bool]


def _key(labels: Mapping[str, str], by: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(labels.get(k, "") for k in by)


def sum_by(
    samples: Iterable[Sample], name: str, by: tuple[str, ...], where: Where | None = None
) -> dict[tuple[str, ...], float]:
    """sum by (`by`) (name{where}), like PromQL's."""
    totals: dict[tuple[str, ...], float] = {}
    for s in samples:
        if s.name == name and (where is None or where(s.labels)):
            key = _key(s.labels, by)
            totals[key] = totals.get(key, 0.0) + s.value
    return totals


def _identity(s: Sample) -> tuple[str, Labels]:
    return s.name, tuple(sorted(s.labels.items()))


def delta(before: Iterable[Sample], after: Iterable[Sample]) -> list[Sample]:
    """Counter increases from `before` to `after`; a series that restarted (went down)
    counts from zero, one that is new counts whole."""
    old = {_identity(s): s.value for s in before}
    found = []
    for s in after:
        previous = old.get(_identity(s), 0.0)
        increase = s.value - previous if s.value >= previous else s.value
        found.append(Sample(s.name, s.labels, increase))
    return found


def quantile(q: float, buckets: Mapping[float, float]) -> float:
    """The q-quantile of a histogram's cumulative bucket counts ({le: count}), interpolated
    linearly inside the bucket, as PromQL's histogram_quantile; NaN without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # the highest finite bound, as Prometheus answers
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def quantiles_by(
    samples: Iterable[Sample],
    histogram: str,
    by: tuple[str, ...],
    qs: tuple[float, ...],
    where: Where | None = None,
) -> dict[tuple[str, ...], tuple[float, ...]]:
    """Per group, the quantiles `qs` of a histogram's (delta) bucket counts."""
    groups: dict[tuple[str, ...], dict[float, float]] = {}
    for s in samples:
        if s.name != f"{histogram}_bucket" or (where is not None and not where(s.labels)):
            continue
        le = float(s.labels["le"])
        group = groups.setdefault(_key(s.labels, by), {})
        group[le] = group.get(le, 0.0) + s.value
    return {key: tuple(quantile(q, b) for q in qs) for key, b in groups.items()}
