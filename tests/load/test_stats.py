"""servemesh.load's numbers on known data: the one percentile, windows, summaries."""

from __future__ import annotations

import math
from typing import Any

import pytest

from servemesh.load import (
    CLIENT_OVERLOADED,
    FixedRate,
    Outcome,
    SendTimes,
    percentile,
    share,
    success_ratio,
    summarize,
    window,
    window_stats,
)
from servemesh.load.stats import FALLBACK_REASON_CHARS


def ok(sent_s: float, latency_ms: float, **kw: Any) -> Outcome:
    return Outcome(sent_s, latency_ms, "OK", **kw)


def test_percentile_is_the_nearest_rank() -> None:
    values = [35.0, 20.0, 15.0, 50.0, 40.0]  # unsorted on purpose
    assert [percentile(values, p) for p in (5, 30, 40, 50, 100)] == [15, 20, 20, 35, 50]
    assert percentile(values, 0) == 15  # p0: the smallest value
    assert percentile(values, 99.9) == 50
    assert percentile(range(1, 101), 99) == 99  # a value some request really had
    assert percentile(range(1, 101), 90) == 90


def test_percentile_edges_empty_one_value_and_bounds() -> None:
    assert math.isnan(percentile([], 50))
    assert [percentile([7.5], p) for p in (0, 1, 50, 99, 100)] == [7.5] * 5
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0], -1)


def test_a_window_is_chosen_by_send_time_half_open() -> None:
    outcomes = [ok(0.0, 1), ok(0.5, 900), ok(1.0, 1), ok(1.999, 1), ok(2.0, 1)]
    # A request due at 0.5 s that took 900 ms still belongs to [0, 1): it was asked then.
    assert [o.sent_s for o in window(outcomes, 0.0, 1.0)] == [0.0, 0.5]
    assert [o.sent_s for o in window(outcomes, 1.0, 2.0)] == [1.0, 1.999]
    assert [o.sent_s for o in window(outcomes, 1.5)] == [1.999, 2.0]  # open-ended
    assert window(outcomes, 3.0, 4.0) == []
    stats = window_stats(outcomes, 0.0, 1.0)
    assert (stats.sent, stats.p50_ms, stats.p99_ms) == (2, 1, 900)
    assert math.isnan(window_stats(outcomes, 3.0, 4.0).p99_ms)


def test_fallbacks_are_counted_by_their_reason_most_frequent_first() -> None:
    head = "model: upstream connect error or disconnect/reset before headers. reset reason: "
    long_reason = head + "connection failure, transport failure reason: delayed connect error: 111"
    outcomes = [
        ok(0, 1, degraded=True, degraded_reason="features: connection refused"),
        ok(0, 1, degraded=True, degraded_reason=long_reason),
        ok(0, 1, degraded=True, degraded_reason=long_reason.replace("111", "113")),
        ok(0, 1, degraded=True),
        ok(0, 1),  # a real answer is no fallback
        Outcome(0, 1, "UNAVAILABLE", degraded_reason="ignored: not an answer"),
    ]
    stats = window_stats(outcomes, 0, 1)
    # The long reasons differ only past their first words: one key, counted twice.
    assert stats.fallbacks == {
        long_reason[:FALLBACK_REASON_CHARS]: 2,
        "features: connection refused": 1,
        "no reason given": 1,
    }
    assert list(stats.fallbacks)[0] == long_reason[:FALLBACK_REASON_CHARS]
    assert stats.degraded == sum(stats.fallbacks.values())


def test_success_ratio_and_share_count_answers() -> None:
    outcomes = [
        ok(0, 1, zone="zone-a"),
        ok(0, 1, zone="zone-b"),
        ok(0, 1, zone="zone-b"),
        Outcome(0, 1, "UNAVAILABLE"),
    ]
    assert success_ratio(outcomes) == 0.75
    assert share(outcomes, lambda o: o.zone == "zone-b") == pytest.approx(2 / 3)
    assert math.isnan(success_ratio([])) and math.isnan(share(outcomes[3:], lambda o: True))


def test_summary_of_a_window() -> None:
    answered = [ok(i / 100, float(i), lag_ms=0.5) for i in range(1, 101)]
    failed = [Outcome(1.0, 3.0, "DEADLINE_EXCEEDED")] * 3
    refused = [Outcome(1.0, math.nan, CLIENT_OVERLOADED)]
    summary = summarize(answered + failed + refused, seconds=10.0)
    assert (summary.count, summary.ok) == (104, 100)
    assert (summary.p50_ms, summary.p90_ms, summary.p95_ms, summary.p99_ms) == (50, 90, 95, 99)
    assert summary.mean_ms == pytest.approx(50.5)
    assert summary.throughput_per_s == 10.0
    assert summary.errors == {"DEADLINE_EXCEEDED": 3, CLIENT_OVERLOADED: 1}
    assert summary.send_lag_p99_ms == 0.5
    empty = summarize([], seconds=1.0)
    assert empty.count == 0 and math.isnan(empty.p99_ms) and empty.throughput_per_s == 0.0


def test_a_drill_window_and_a_benchmark_summary_report_the_same_p99() -> None:
    outcomes = [ok(i / 1000, float((i * 37) % 1000)) for i in range(1000)]
    assert window_stats(outcomes, 0, 1).p99_ms == summarize(outcomes, 1.0).p99_ms == 989.0


def test_schedules_are_fixed_before_the_run() -> None:
    schedule = FixedRate(rate_per_s=150, duration_s=9)
    assert schedule.count == 1350
    assert schedule.due_s(0) == 0.0 and schedule.due_s(300) == 2.0
    assert FixedRate(rate_per_s=3, duration_s=1.1).count == 4  # due at 0, 1/3, 2/3, 1
    assert FixedRate(rate_per_s=10).count is None  # until stopped
    with pytest.raises(ValueError):
        FixedRate(rate_per_s=0)
    times = SendTimes([0.0, 0.0, 0.25])
    assert times.count == 3 and times.due_s(2) == 0.25
    with pytest.raises(ValueError):
        SendTimes([0.5, 0.25])
