"""`servemesh top`'s tiers section from counters: each model's tier, its lookups per second,
how they ended, and the share of the model's answers it gave."""

from __future__ import annotations

import pytest
from rich.console import Console

from servemesh.observe.top import Row, TierRow, TopReport, render, tier_rows


def test_hit_ratio_and_share_of_answers_per_model_and_tier() -> None:
    lookups: dict[tuple[str, ...], float] = {
        ("fraud", "precomputed", "hit"): 60.0,
        ("fraud", "precomputed", "miss"): 40.0,
        ("fraud", "cache", "hit"): 10.0,
        ("fraud", "cache", "miss"): 25.0,
        ("fraud", "cache", "stale"): 5.0,
    }
    rows = tier_rows(lookups, {("fraud",): 100.0}, seconds=10.0)
    assert [(r.model, r.tier) for r in rows] == [("fraud", "cache"), ("fraud", "precomputed")]
    cache, precomputed = rows
    assert precomputed.lookups_per_s == pytest.approx(10.0)
    assert precomputed.hit_ratio == pytest.approx(0.6)
    assert precomputed.answered_share == pytest.approx(0.6)
    assert cache.hit_ratio == pytest.approx(0.25) and cache.stale_ratio == pytest.approx(0.125)
    assert cache.skipped_ratio == 0.0
    assert cache.answered_share == pytest.approx(0.1)


def test_a_model_without_answers_has_no_share_and_the_table_says_so() -> None:
    (row,) = tier_rows({("fraud", "cache", "skipped"): 8.0}, {}, seconds=4.0)
    assert row.skipped_ratio == 1.0 and row.hit_ratio == 0.0 and row.answered_share is None
    console = Console(width=160, record=True)
    console.print(render(TopReport(source="metrics endpoints", seconds=4.0, tiers=[row])))
    text = console.export_text()
    assert "tiers (lookups at the gateways)" in text
    line = next(line for line in text.splitlines() if "fraud" in line and "cache" in line)
    cells = [cell.strip() for cell in line.strip("│ ").split("│")]
    assert cells == ["fraud", "cache", "2.0", "0.00%", "0.00%", "100.00%", "-"]


def test_no_tiers_no_section() -> None:
    console = Console(width=160, record=True)
    console.print(render(TopReport(source="metrics endpoints", seconds=1.0)))
    assert "tiers" not in console.export_text()
    assert TierRow("m", "cache", 0.0, None, None, None, None).as_dict()["hit_ratio"] is None


def test_a_version_row_without_a_version_says_what_it_counts() -> None:
    # The gateways count a call that failed before any version was chosen (NOT_FOUND for an
    # entity of no view, a bad input) under version "": the row says so, never "(none)".
    failed = Row({"model": "risk", "version": ""}, rps=0.5, error_ratio=1.0, p50_ms=1.0, p99_ms=2.0)
    console = Console(width=160, record=True)
    console.print(render(TopReport(source="metrics endpoints", seconds=4.0, versions=[failed])))
    line = next(line for line in console.export_text().splitlines() if "risk" in line)
    cells = [cell.strip() for cell in line.strip("│ ").split("│")]
    assert cells[:2] == ["risk", "(none: failed before routing)"]
