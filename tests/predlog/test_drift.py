"""Drift's statistics without a mesh: a reference summarised from a Parquet file, PSI and the
chi-square test per feature against live values, the verdicts, and a report read from a
prediction log of real Parquet files."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servemesh.predlog.buffer import predictions_dir
from servemesh.predlog.drift import (
    OTHER,
    NumericSummary,
    category_key,
    compare,
    compare_categorical,
    compare_numeric,
    summarise_categorical,
    summarise_numeric,
)
from servemesh.predlog.parquet_store import ParquetStore
from servemesh.predlog.query import ParquetReader
from servemesh.predlog.references import (
    NoReference,
    all_references,
    drift_report,
    find_reference,
    reference_from_parquet,
    remove_reference,
    save_reference,
)
from servemesh.rollout.stats import chi2_sf
from servemesh.spec import DriftSpec
from tests.predlog.records import LOGGED, row, vector

SETTINGS = DriftSpec()


def test_psi_and_p_value_are_those_computed_by_hand() -> None:
    # Two bins, half the reference each; live values 20% / 80%.
    summary = NumericSummary(edges=[0.0], counts=[50, 50], mean=0.0, std=1.0)
    live = [-1.0] * 20 + [1.0] * 80
    found = compare_numeric("x", summary, live, SETTINGS)
    by_hand = (0.2 - 0.5) * math.log(0.2 / 0.5) + (0.8 - 0.5) * math.log(0.8 / 0.5)
    assert found.psi == pytest.approx(by_hand)
    # Expected counts 35 and 65 in each row: chi-square 2 x 15^2 (1/35 + 1/65), 1 degree of
    # freedom (the rollout analysis's closed form, independent of scipy).
    statistic = 2 * 15**2 * (1 / 35 + 1 / 65)
    assert found.p_value == pytest.approx(chi2_sf(statistic, 1))
    assert (found.rows, found.bins) == (100, 2)
    # A value on an edge is in the bin below it: (-inf, 0], (0, inf).
    on_edge = compare_numeric("x", summary, [0.0] * 50 + [0.5] * 50, SETTINGS)
    assert on_edge.psi == pytest.approx(0.0)


def test_a_shifted_numeric_feature_drifts_and_the_unshifted_one_does_not() -> None:
    rng = np.random.default_rng(3)
    reference = summarise_numeric(rng.normal(0.0, 1.0, 5000))
    assert len(reference.edges) == 9 and sum(reference.counts) == 5000
    same = compare_numeric("f01", reference, rng.normal(0.0, 1.0, 2000).tolist(), SETTINGS)
    moved = compare_numeric("f00", reference, rng.normal(1.0, 1.0, 2000).tolist(), SETTINGS)
    assert same.verdict == "ok" and same.psi is not None and same.psi < 0.05
    assert same.p_value is not None and same.p_value > 0.01
    assert moved.verdict == "drifting" and moved.psi is not None and moved.psi > 0.5
    assert moved.p_value is not None and moved.p_value < 1e-10
    before, after = moved.detail.removeprefix("mean ").split(" -> ")
    assert abs(float(before)) < 0.1 and abs(float(after) - 1.0) < 0.1


def test_a_small_sample_gets_no_verdict_however_far_it_moved() -> None:
    reference = summarise_numeric(np.random.default_rng(4).normal(0.0, 1.0, 5000))
    few = compare_numeric("x", reference, [5.0] * 50, SETTINGS)
    assert few.verdict == "too few rows" and few.psi is not None and few.psi > 1
    none = compare_numeric("x", reference, ["text", None, math.nan], SETTINGS)
    assert (none.verdict, none.rows, none.psi) == ("no values", 0, None)


def test_a_large_psi_without_a_small_p_value_is_watched_not_drifting() -> None:
    summary = NumericSummary(edges=[0.0], counts=[3, 3], mean=0.0, std=1.0)
    loose = DriftSpec(min_rows=10)
    found = compare_numeric("x", summary, [-1.0] * 3 + [1.0] * 9, loose)
    assert found.psi is not None and found.psi >= loose.psi_drifting
    assert found.p_value is not None and found.p_value > loose.p_value
    assert found.verdict == "watch"


def test_repeated_values_make_fewer_bins_and_nans_count_as_missing() -> None:
    values = np.array([0.0] * 70 + [1.0] * 30 + [math.nan] * 5)
    summary = summarise_numeric(values)
    assert summary.edges == [0.0, 1.0] and summary.counts == [70, 30, 0]
    assert summary.missing == 5


def test_categories_compare_by_share_and_unseen_ones_count_together() -> None:
    rng = np.random.default_rng(5)
    reference = summarise_categorical(
        rng.choice(["gold", "silver", "bronze"], p=[0.2, 0.3, 0.5], size=4000).tolist()
    )
    assert reference.categories == ["bronze", "silver", "gold"] and reference.other == 0
    same = compare_categorical(
        "tier",
        reference,
        rng.choice(["gold", "silver", "bronze"], p=[0.2, 0.3, 0.5], size=1000).tolist(),
        SETTINGS,
    )
    assert same.verdict == "ok"
    moved = compare_categorical(
        "tier",
        reference,
        rng.choice(["gold", "silver", "platinum"], p=[0.5, 0.3, 0.2], size=1000).tolist(),
        SETTINGS,
    )
    assert moved.verdict == "drifting" and moved.bins == 4
    assert moved.detail.startswith("bronze ") and moved.detail.endswith(" -> 0%")
    # Only the top categories are kept by name.
    kept = summarise_categorical(["a", "a", "b", "c", "d"], max_categories=2)
    assert (kept.categories, kept.counts, kept.other) == (["a", "b"], [2, 1], 2)
    assert OTHER == "(other)"


def test_a_category_is_the_same_text_from_a_file_and_from_json() -> None:
    assert category_key(np.int64(3)) == category_key(3) == category_key(3.0) == "3"
    assert category_key(True) == category_key(np.bool_(True)) == "true"
    assert category_key(2.5) == "2.5" and category_key("gold") == "gold"
    assert category_key(None) is None and category_key(math.nan) is None


def test_a_reference_file_is_summarised_column_by_column(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.table(
            {
                "amount": rng.normal(50.0, 10.0, 1000),
                "tier": rng.choice(["gold", "silver"], size=1000),
                "category": rng.integers(0, 5, size=1000),
                "member": rng.integers(0, 2, size=1000).astype(bool),
                "tags": [["a"]] * 1000,
            }
        ),
        path,
    )
    reference, skipped = reference_from_parquet(path, "churn", categorical=["category"])
    kinds = {name: s.kind for name, s in reference.features.items()}
    assert kinds == {
        "amount": "numeric",
        "tier": "categorical",
        "category": "categorical",
        "member": "categorical",
    }
    assert skipped == ["tags"] and reference.rows == 1000 and reference.source == str(path)
    category = reference.features["category"]
    assert category.kind == "categorical" and sorted(category.categories) == list("01234")
    with pytest.raises(NoReference, match="has no column 'nope'"):
        reference_from_parquet(path, "churn", categorical=["nope"])
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(NoReference, match="not a readable Parquet file"):
        reference_from_parquet(tmp_path / "bad.parquet", "churn")


def test_a_version_s_reference_comes_before_the_model_s(tmp_path: Path) -> None:
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"f00": np.arange(100.0)}), rows)
    model_wide, _ = reference_from_parquet(rows, "fraud")
    for_v2, _ = reference_from_parquet(rows, "fraud", "v2")
    save_reference(tmp_path, model_wide)
    save_reference(tmp_path, for_v2)
    assert find_reference(tmp_path, "fraud", "v2").version == "v2"
    assert find_reference(tmp_path, "fraud", "v1").version is None
    assert find_reference(tmp_path, "fraud").version is None
    assert [(r.model, r.version) for r in all_references(tmp_path)] == [
        ("fraud", None),
        ("fraud", "v2"),
    ]
    assert remove_reference(tmp_path, "fraud") and not remove_reference(tmp_path, "fraud")
    with pytest.raises(NoReference, match="--set-reference"):
        find_reference(tmp_path, "fraud", "v1")
    (tmp_path / "drift" / "fraud.json").write_text("{}")
    with pytest.raises(NoReference, match="not a drift reference"):
        find_reference(tmp_path, "fraud")


def test_the_report_reads_the_logged_values_of_the_window(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    reference_rows = tmp_path / "train.parquet"
    pq.write_table(
        pa.table({"f00": rng.normal(0, 1, 3000), "f01": rng.normal(0, 1, 3000)}), reference_rows
    )
    reference, _ = reference_from_parquet(reference_rows, "fraud")
    now = time.time()
    store = ParquetStore(predictions_dir(tmp_path), "gateway-zone-a-0")
    calls = []
    for i in range(300):
        shifted = [[float(rng.normal(2, 1)), float(rng.normal(0, 1)), 0.0] for _ in range(2)]
        calls.append(row(now - 60 - i, context=LOGGED, inputs=vector(*shifted)))
    old = [[9.0, 9.0, 9.0]]  # past the window: never compared
    calls.append(row(now - 7200, context=LOGGED, inputs=vector(*old)))
    calls.append(row(now - 30))  # a call whose values were not kept
    store.write(calls)
    reader = ParquetReader(predictions_dir(tmp_path))
    report = drift_report(reader, reference, SETTINGS, model="fraud", window_s=3600)
    assert (report.calls, report.with_values, report.read) == (301, 300, 300)
    verdicts = {f.feature: (f.verdict, f.rows) for f in report.features}
    assert verdicts == {"f00": ("drifting", 600), "f01": ("ok", 600)}
    assert report.drifting == ["f00"]
    data = report.as_dict()
    assert data["drifting"] == ["f00"] and data["features"][0]["feature"] == "f00"
    # A feature the log never holds is reported without values.
    missing = reference.model_copy(
        update={"features": {"f09": reference.features["f00"], **reference.features}}
    )
    shown = compare(missing, {"f00": [0.0]}, SETTINGS)
    assert [(f.feature, f.verdict) for f in shown][:2] == [
        ("f09", "no values"),
        ("f00", "too few rows"),
    ]
