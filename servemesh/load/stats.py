"""The numbers read from outcomes: windows, success and shares, summaries, and the one
percentile of servemesh (`servemesh.contract.percentiles`, nearest rank), kept importable here.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from servemesh.contract.percentiles import percentile as percentile  # kept importable from here
from servemesh.load.outcome import Outcome

# A benchmark row whose req/s spreads over this share of its median is measured once more,
# and flagged if it stays as wide (`servemesh bench predict`, `servemesh bench model`).
SPREAD_LIMIT = 0.25


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of a row's repeats; 0 for a single value, inf when the median is
    0."""
    middle = statistics.median(values)
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / middle if middle else math.inf


def window(outcomes: Iterable[Outcome], start_s: float, end_s: float = math.inf) -> list[Outcome]:
    """Outcomes of requests due in [start_s, end_s): a window is chosen by send time, so a
    request that answers late still counts against the moment it was asked."""
    return [o for o in outcomes if start_s <= o.sent_s < end_s]


def success_ratio(outcomes: Sequence[Outcome]) -> float:
    """Answered / sent, from 0 to 1; NaN for none."""
    return sum(o.ok for o in outcomes) / len(outcomes) if outcomes else math.nan


def share(outcomes: Sequence[Outcome], key: Callable[[Outcome], bool]) -> float:
    """The share (0 to 1) of answered requests for which `key` holds; NaN for none."""
    answered = [o for o in outcomes if o.ok]
    return sum(key(o) for o in answered) / len(answered) if answered else math.nan


def error_counts(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """Failures by code, in order of first appearance."""
    return dict(Counter(o.code for o in outcomes if not o.ok))


@dataclass(frozen=True)
class Summary:
    """A measured window: how many were sent and answered, latency of the answers, and how
    late the client sent (a large send lag means the client, not the server, fell behind)."""

    count: int  # requests due in the window
    ok: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    throughput_per_s: float  # answers per second of window
    send_lag_p99_ms: float
    errors: dict[str, int] = field(default_factory=dict)


def summarize(outcomes: Sequence[Outcome], seconds: float) -> Summary:
    """Latency percentiles and mean of the answered requests among `outcomes`, which span
    `seconds` of schedule."""
    latencies = [o.latency_ms for o in outcomes if o.ok]
    lags = [o.lag_ms for o in outcomes if not math.isnan(o.latency_ms)]
    return Summary(
        count=len(outcomes),
        ok=len(latencies),
        seconds=seconds,
        p50_ms=percentile(latencies, 50),
        p90_ms=percentile(latencies, 90),
        p95_ms=percentile(latencies, 95),
        p99_ms=percentile(latencies, 99),
        mean_ms=statistics.fmean(latencies) if latencies else math.nan,
        throughput_per_s=len(latencies) / seconds if seconds > 0 else 0.0,
        send_lag_p99_ms=percentile(lags, 99),
        errors=error_counts(outcomes),
    )


@dataclass(frozen=True)
class WindowStats:
    """What callers saw from requests sent in [start_s, end_s)."""

    start_s: float
    end_s: float
    sent: int
    ok: int
    failed: int
    degraded: int
    success_pct: float  # answered (a degraded fallback is an answer) / sent
    degraded_pct: float  # degraded / answered
    p50_ms: float  # of answered calls
    p99_ms: float
    zones: dict[str, float] = field(default_factory=dict)  # % of answers served per zone
    versions: dict[str, float] = field(default_factory=dict)  # % of answers per version
    codes: dict[str, int] = field(default_factory=dict)  # failures by gRPC status
    # Degraded answers by their reason (the hop that failed and its error's first words)
    fallbacks: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: floats rounded to 3 places, NaN (nothing to measure) as None."""
        data = asdict(self)
        for key, value in data.items():
            if isinstance(value, float):
                data[key] = None if math.isnan(value) else round(value, 3)
        return data


def window_stats(outcomes: Iterable[Outcome], start_s: float, end_s: float) -> WindowStats:
    chosen = window(outcomes, start_s, end_s)
    ok = [o for o in chosen if o.ok]
    degraded = sum(o.degraded for o in ok)
    served = [o for o in ok if not o.degraded]
    latencies = [o.latency_ms for o in ok]
    zones = Counter(o.zone or "?" for o in served)
    versions = Counter(o.version or "?" for o in ok)
    return WindowStats(
        start_s=start_s,
        end_s=end_s,
        sent=len(chosen),
        ok=len(ok),
        failed=len(chosen) - len(ok),
        degraded=degraded,
        success_pct=100 * len(ok) / len(chosen) if chosen else math.nan,
        degraded_pct=100 * degraded / len(ok) if ok else math.nan,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        zones={z: 100 * n / len(served) for z, n in sorted(zones.items())},
        versions={v: 100 * n / len(ok) for v, n in sorted(versions.items())},
        codes=error_counts(chosen),
        fallbacks=fallback_counts(ok),
    )


# A degraded reason's first characters: enough for the hop and the error's kind, while the
# rest (addresses, timings) would give every answer a key of its own.
FALLBACK_REASON_CHARS = 80


def fallback_counts(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """Degraded answers by reason, the most frequent first."""
    counts = Counter(
        (o.degraded_reason or "no reason given")[:FALLBACK_REASON_CHARS]
        for o in outcomes
        if o.degraded
    )
    return dict(counts.most_common())
