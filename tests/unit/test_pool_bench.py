"""`servemesh bench pool`'s arithmetic: the call mixes, the budget it sizes, its report."""

from __future__ import annotations

from pathlib import Path

import pytest

from servemesh.bench.model.pool import (
    DEMO_WEIGHT_BYTES,
    POOL,
    Round,
    aggregate,
    bench_spec,
    weights,
)


def test_the_mixes_spread_calls_over_every_model() -> None:
    uniform = weights("uniform", 20)
    zipf = weights("zipf", 20)
    assert uniform.sum() == pytest.approx(1) and zipf.sum() == pytest.approx(1)
    assert set(uniform.round(6)) == {0.05}
    # Zipf: the hot models first, and every model still called.
    assert 0.55 < zipf[:5].sum() < 0.7 and zipf.min() > 0


def test_the_budget_holds_exactly_the_models_asked(tmp_path: Path) -> None:
    spec = bench_spec(tmp_path, 20, 5)
    budget = spec.pools[POOL].memory_budget
    assert budget is not None and spec.pools[POOL].on_demand
    assert 5 * DEMO_WEIGHT_BYTES <= budget < 6 * DEMO_WEIGHT_BYTES
    assert len(spec.pool_models(POOL)) == 20


def test_the_report_gives_the_median_and_spread_and_counts_every_error() -> None:
    rounds = [
        Round("zipf", 2.0, calls=10, cold_ms=[100.0, 200.0], warm_ms=[1.0] * 8, evictions=2),
        Round("zipf", 2.0, calls=20, errors={"UNAVAILABLE": 1}, cold_ms=[50.0], warm_ms=[2.0] * 18),
    ]
    [zipf] = aggregate(rounds)
    assert zipf["errors_total"] == 1
    assert zipf["rps"] == {"median": 7.5, "min": 5.0, "max": 10.0}
    assert zipf["hit_ratio"]["min"] == pytest.approx(0.8)
