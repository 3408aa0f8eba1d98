"""What the rollout controller asks before and after the shadow step: the checklist items
and the gates (freeze, error budget), with the caller's overrides marked, and the table
`servemesh rollout start` prints.

- `preflight`: the items that need no traffic: artifact_integrity, offline_metrics,
  rollback_target, freeze, error_budget.
- `after_shadow`: the items judged on the shadow step's traffic: shadow_latency and
  distribution.

Each returns every item, passed or failed; an item blocks (`ChecklistItem.blocks`) when it
failed and the caller did not override it. docs/rollouts-gates.md explains each judgement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from rich.table import Table
from rich.text import Text

from servemesh.rollout.budget import BudgetUnreadable, read_budget
from servemesh.rollout.checklist import (
    ERROR_BUDGET,
    FREEZE,
    apply_overrides,
    check_overrides,
    failed,
    judge_distribution,
    judge_shadow_latency,
    known_items,
    passed,
    registry_items,
    rollback_target_item,
)
from servemesh.rollout.freeze import freeze_detail
from servemesh.rollout.types import ArmWindow, ChecklistItem
from servemesh.spec import ResolvedSpec
from servemesh.spec.rollout_plan import RolloutPlan, SloSpec

__all__ = [
    "after_shadow",
    "error_budget_item",
    "freeze_item",
    "known_items",
    "preflight",
    "render_checklist",
]


def freeze_item(spec: ResolvedSpec, *, now: datetime) -> ChecklistItem:
    """`freeze`: fails while a weekly window or a holiday of `rollout.freeze` holds."""
    ok, detail = freeze_detail(spec.rollout.freeze, now)
    return passed(FREEZE, detail) if ok else failed(FREEZE, detail)


def error_budget_item(spec: ResolvedSpec, model: str) -> ChecklistItem:
    """`error_budget`: fails when the model's budget is spent or it burns fast."""
    slo = spec.rollout.slos.get(model)
    if slo is None:
        return passed(ERROR_BUDGET, f"no SLO for {model} in rollout.slos: no budget to keep")
    try:
        reading = read_budget(spec, model, slo)
    except BudgetUnreadable as exc:
        return failed(ERROR_BUDGET, f"cannot read the budget: {exc}")
    return (
        failed(ERROR_BUDGET, reading.detail())
        if reading.refuses
        else passed(ERROR_BUDGET, reading.detail())
    )


def preflight(
    spec: ResolvedSpec,
    model: str,
    version: str,
    plan: RolloutPlan,
    *,
    now: datetime,
    overrides: Mapping[str, str],
) -> list[ChecklistItem]:
    """The checklist items that need no traffic, and the gates, in the order printed.

    `overrides` maps item name -> reason; an unknown name or an empty reason raises
    OverrideError (a ValueError) before anything is read."""
    check_overrides(overrides)
    integrity, metrics = registry_items(spec, model, version, plan.checklist.offline_metrics)
    items = [
        integrity,
        metrics,
        rollback_target_item(spec, model, version),
        freeze_item(spec, now=now),
        error_budget_item(spec, model),
    ]
    return apply_overrides(items, overrides)


def after_shadow(
    windows: Mapping[str, ArmWindow],
    baseline: str,
    canary: str,
    plan: RolloutPlan,
    slo: SloSpec | None,
    *,
    overrides: Mapping[str, str],
) -> list[ChecklistItem]:
    """`shadow_latency` (the canary's p99 within plan.checklist.shadow_p99_ms, else the
    SLO's p99) and `distribution` (scores present, within plan.checklist.score_range)."""
    check_overrides(overrides)
    limit = plan.checklist.shadow_p99_ms
    source = "checklist.shadow_p99_ms"
    if limit is None and slo is not None:
        limit, source = slo.p99_ms, "the SLO's p99_ms"
    items = [
        judge_shadow_latency(windows, baseline, canary, limit, source),
        judge_distribution(windows, canary, plan.checklist.score_range),
    ]
    return apply_overrides(items, overrides)


def render_checklist(items: Sequence[ChecklistItem]) -> Table:
    """One row per item: ✓ passed, ✗ failed, ! failed but overridden (with the reason)."""
    table = Table(title="checklist", title_justify="left", show_header=False, box=None)
    table.add_column("", no_wrap=True)
    table.add_column("item", no_wrap=True)
    table.add_column("detail")
    for item in items:
        if item.ok:
            mark = Text("✓", style="green")
            detail = Text(item.detail)
        elif item.override_reason is not None:
            mark = Text("!", style="yellow")
            detail = Text(f"{item.detail} — overridden: {item.override_reason}")
        else:
            mark = Text("✗", style="bold red")
            detail = Text(item.detail)
        table.add_row(mark, item.name, detail)
    return table
