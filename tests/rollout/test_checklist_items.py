"""The checklist's judgements on plain values: offline metrics against the plan, the
rollback target from Envoy's live view, shadow latency and the score distribution from arm
windows, overrides, and the printed table."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from servemesh.proxy.live_view import VersionView
from servemesh.rollout.checklist import (
    OverrideError,
    apply_overrides,
    judge_offline_metrics,
    judge_rollback_target,
    known_items,
    p99_ms,
)
from servemesh.rollout.gates import after_shadow, render_checklist
from servemesh.rollout.types import ArmWindow, ChecklistItem
from servemesh.spec.rollout_plan import ChecklistSpec, RolloutPlan, SloSpec

LATENCY_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, math.inf)
SCORE_BOUNDS = (0.0, 0.25, 0.5, 0.75, 1.0, math.inf)


def arm(
    version: str, latency: tuple[int, ...] = (0,) * 6, scores: tuple[int, ...] = (0,) * 6
) -> ArmWindow:
    return ArmWindow(
        version=version,
        requests=sum(latency),
        errors=0,
        latency_bounds_s=LATENCY_BOUNDS,
        latency_buckets=latency,
        score_bounds=SCORE_BOUNDS,
        score_buckets=scores,
    )


# --- offline metrics ----------------------------------------------------------------------


def test_offline_metrics_pass_when_every_threshold_holds() -> None:
    item = judge_offline_metrics(
        {"auc": 0.91, "log_loss": 0.2, "extra": 1.0},
        {"auc": ">=0.8", "log_loss": "<0.3"},
        record="fraud/v2",
    )
    assert item.ok
    assert item.detail == "auc 0.91 >= 0.8; log_loss 0.2 < 0.3"


def test_a_metric_below_its_threshold_fails_naming_the_numbers() -> None:
    item = judge_offline_metrics({"auc": 0.71}, {"auc": ">=0.8"}, record="fraud/v2")
    assert not item.ok and item.blocks
    assert item.detail == "auc 0.71 < 0.8 (needs >=0.8)"


def test_a_metric_the_plan_names_but_the_record_lacks_fails_naming_it() -> None:
    item = judge_offline_metrics(
        {"auc": 0.9}, {"auc": ">=0.8", "recall": ">0.5"}, record="fraud/v2"
    )
    assert not item.ok
    assert item.detail == "recall missing from fraud/v2's metrics (it has: auc); auc 0.9 >= 0.8"


def test_no_thresholds_pass_saying_so_and_a_nan_metric_fails() -> None:
    assert judge_offline_metrics({}, {}, record="fraud/v2").detail == "no thresholds in the plan"
    assert not judge_offline_metrics({"auc": math.nan}, {"auc": ">=0.8"}, record="r").ok


DERIVED = {"source_version": "v1", "source_sha256": "ab" * 32, "method": "dynamic-int8"}


def test_a_derived_version_is_held_to_the_limits_it_was_quantized_under() -> None:
    metrics = {"quantize_max_abs_error": 0.004, "quantize_label_agreement": 1.0}
    item = judge_offline_metrics(metrics, {}, record="fraud/v1-int8", lineage=DERIVED)
    assert item.ok
    assert item.detail == (
        "dynamic-int8 of v1; quantize_label_agreement 1 >= 0.99; "
        "quantize_max_abs_error 0.004 <= 0.05"
    )
    # Pushed by hand past the defaults: stopped here even with no thresholds in the plan.
    loose = {"quantize_max_abs_error": 0.2, "quantize_label_agreement": 0.9}
    item = judge_offline_metrics(loose, {}, record="fraud/v1-int8", lineage=DERIVED)
    assert not item.ok
    assert "quantize_max_abs_error 0.2 > 0.05 (needs <=0.05)" in item.detail
    assert "quantize_label_agreement 0.9 < 0.99 (needs >=0.99)" in item.detail
    # The plan's own limit for a metric wins over the default.
    item = judge_offline_metrics(
        loose,
        {"quantize_max_abs_error": "<=0.25", "quantize_label_agreement": ">=0.8"},
        record="fraud/v1-int8",
        lineage=DERIVED,
    )
    assert item.ok, item.detail
    # A derived version without its accuracy metrics fails, naming them.
    item = judge_offline_metrics({}, {}, record="fraud/v1-int8", lineage=DERIVED)
    assert not item.ok and "quantize_max_abs_error missing" in item.detail
    # A version that is not derived (a data lineage only) is not.
    plain = judge_offline_metrics({}, {}, record="fraud/v2", lineage={"data": "sha256:x"})
    assert plain.ok and plain.detail == "no thresholds in the plan"


def test_a_bad_threshold_in_a_plan_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="offline_metrics.auc"):
        ChecklistSpec.model_validate({"offline_metrics": {"auc": "about 0.8"}})


# --- rollback target ------------------------------------------------------------------------


def view(version: str, weight: int, healthy: int, hosts: int = 2) -> VersionView:
    return VersionView(
        "fraud",
        version,
        weight,
        False,
        healthy={"zone-a": min(healthy, 1), "zone-b": max(healthy - 1, 0)},
        hosts={"zone-a": 1, "zone-b": hosts - 1},
    )


def test_the_rollback_target_is_the_heaviest_other_version_and_healthy() -> None:
    rows = [view("v1", 90, 2), view("v2", 0, 2), view("v3", 10, 0)]
    item = judge_rollback_target(rows, "fraud", "v2")
    assert item.ok
    assert item.detail == "fraud v1 (weight 90) healthy on 2 of 2 hosts (zone-a 1/1, zone-b 1/1)"


def test_no_other_version_with_traffic_fails() -> None:
    item = judge_rollback_target([view("v1", 0, 2), view("v2", 100, 2)], "fraud", "v2")
    assert not item.ok
    assert item.detail == (
        "no version of fraud but v2 takes traffic (weights: v1 0, v2 100): nothing to roll back to"
    )


def test_a_baseline_without_a_healthy_host_fails() -> None:
    item = judge_rollback_target([view("v1", 100, 0), view("v2", 0, 2)], "fraud", "v2")
    assert not item.ok
    assert (
        item.detail == "fraud v1 (weight 100) has no healthy host (0 of 2; zone-a 0/1, zone-b 0/1)"
    )
    assert not judge_rollback_target([], "churn", "v2").ok


# --- after the shadow step ------------------------------------------------------------------


def test_p99_is_interpolated_inside_its_bucket_as_promql_does() -> None:
    # 100 calls: 98 under 10 ms, 2 in (25 ms, 50 ms]; the 99th lies halfway into that bucket.
    window = arm("v2", latency=(98, 0, 2, 0, 0, 0))
    assert p99_ms(window) == pytest.approx(37.5)


def test_shadow_latency_is_judged_against_the_plan_sla_else_the_slo() -> None:
    windows = {"v1": arm("v1", latency=(100, 0, 0, 0, 0, 0)), "v2": arm("v2", (0, 0, 0, 100, 0, 0))}
    plan = RolloutPlan(checklist=ChecklistSpec(shadow_p99_ms=80))
    latency, _ = after_shadow(windows, "v1", "v2", plan, SloSpec(p99_ms=500), overrides={})
    assert not latency.ok
    assert latency.detail == (
        "v2 p99 99.5 ms over 100 shadow calls (baseline v1 9.9 ms) > 80 ms "
        "(checklist.shadow_p99_ms)"
    )
    latency, _ = after_shadow(windows, "v1", "v2", RolloutPlan(), SloSpec(p99_ms=250), overrides={})
    assert latency.ok
    assert latency.detail.endswith("<= 250 ms (the SLO's p99_ms)")
    latency, _ = after_shadow(windows, "v1", "v2", RolloutPlan(), None, overrides={})
    assert latency.ok and "no SLA to judge it by" in latency.detail


def test_a_canary_with_no_shadow_calls_fails_both_items() -> None:
    latency, spread = after_shadow({"v1": arm("v1")}, "v1", "v2", RolloutPlan(), None, overrides={})
    assert not latency.ok and latency.detail == "no shadow call timed for v2: nothing to judge"
    assert not spread.ok and spread.detail == "no score recorded for v2 on shadow traffic"


def test_scores_outside_the_range_fail_and_infinite_ones_count_outside() -> None:
    plan = RolloutPlan(checklist=ChecklistSpec(score_range=(0.0, 1.0)))
    inside = {"v2": arm("v2", latency=(5,) + (0,) * 5, scores=(0, 10, 20, 30, 40, 0))}
    _, spread = after_shadow(inside, "v1", "v2", plan, None, overrides={})
    assert spread.ok
    assert spread.detail == "all 100 v2 scores within [0, 1] (by histogram buckets 0..1)"
    # Seven scores above 1.0 (or +inf: the open bucket), three at or below 0 stay ambiguous
    # at the range's edge: (-inf, 0] straddles 0, which is inside [0, 1].
    beyond = {"v2": arm("v2", latency=(5,) + (0,) * 5, scores=(3, 10, 20, 30, 30, 7))}
    _, spread = after_shadow(beyond, "v1", "v2", plan, None, overrides={})
    assert not spread.ok
    assert spread.detail == "7 of 100 v2 scores outside [0, 1] (by histogram buckets 0..1)"
    narrow = RolloutPlan(checklist=ChecklistSpec(score_range=(0.3, 0.6)))
    _, spread = after_shadow(inside, "v1", "v2", narrow, None, overrides={})
    assert not spread.ok and spread.detail.startswith("50 of 100 v2 scores outside [0.3, 0.6]")


# --- overrides and the table ---------------------------------------------------------------


def test_an_overridden_failed_item_is_marked_never_passed() -> None:
    items = [
        ChecklistItem("freeze", False, "inside weekend freeze"),
        ChecklistItem("artifact_integrity", True, "sha256 ok"),
    ]
    marked = apply_overrides(items, {"freeze": "  hotfix for INC-42 ", "artifact_integrity": "x"})
    assert marked[0].ok is False
    assert marked[0].override_reason == "hotfix for INC-42"
    assert not marked[0].blocks
    assert marked[1] == items[1]  # an override of a passing item changes nothing


def test_unknown_override_names_and_empty_reasons_are_refused_listing_the_known_items() -> None:
    with pytest.raises(OverrideError) as refused:
        apply_overrides([], {"frezee": "typo"})
    assert str(refused.value) == (
        "--override: unknown item(s) 'frezee'; known items: " + ", ".join(known_items())
    )
    with pytest.raises(OverrideError, match="--reason: overriding 'freeze' needs a reason"):
        after_shadow({}, "v1", "v2", RolloutPlan(), None, overrides={"freeze": " "})
    assert set(known_items()) == {
        "artifact_integrity",
        "offline_metrics",
        "rollback_target",
        "shadow_latency",
        "distribution",
        "freeze",
        "error_budget",
    }


def test_the_table_shows_passed_failed_and_overridden_items() -> None:
    items = [
        ChecklistItem("artifact_integrity", True, "fraud/v2 sha256 verified"),
        ChecklistItem("offline_metrics", False, "auc 0.71 < 0.8 (needs >=0.8)"),
        ChecklistItem("freeze", False, "inside weekend freeze", override_reason="INC-42 fix"),
    ]
    console = Console(width=160, record=True, color_system=None)
    console.print(render_checklist(items))
    lines = [line.strip() for line in console.export_text().splitlines() if line.strip()]
    assert lines == [
        "checklist",
        "✓  artifact_integrity  fraud/v2 sha256 verified",
        "✗  offline_metrics     auc 0.71 < 0.8 (needs >=0.8)",
        "!  freeze              inside weekend freeze — overridden: INC-42 fix",
    ]
