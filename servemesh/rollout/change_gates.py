"""The gates of `rollout start` on every other path that changes what a model serves.

A freeze window (`rollout.freeze`) or a model's spent error budget (`rollout.slos`) refuses
a rollout; without this module an operator could do by hand what the rollout was refused:
move the weights (`routes set`), start a shadow (`routes shadow`), apply a file that adds
a version or moves weights (`apply`), point an alias at another version (`models alias`),
or roll back a rollback (`routes rollback`). Each asks `enforce` first, with the models it
deploys something for, and is refused (exit 4) while a gate fails, unless the caller
overrides that gate with a reason (`--override freeze --reason TEXT`); once the change is
made, the override goes to `<state_dir>/gate-overrides.jsonl` (and the routes history).

What is never refused: the way back. Weights moved toward the version that serves the most
(a bad canary's share taken away: weights_deploy), a shadow stopped, `apply --dry-run`,
and an apply that only removes versions or models, scales, or changes logs or policy:
none of them sends traffic anywhere new. docs/rollouts-gates.md has the rules.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from servemesh.contract.errors import GATE_REFUSED, ServemeshError
from servemesh.proxy.apply import operator_name
from servemesh.proxy.live_plan import ApplyPlan
from servemesh.rollout.checklist import ERROR_BUDGET, FREEZE, OverrideError, apply_overrides
from servemesh.rollout.gates import error_budget_item, freeze_item
from servemesh.rollout.types import ChecklistItem
from servemesh.spec import MeshSpec, ResolvedSpec

# The items a change path may override (the rollout's other items judge a version's
# artifact and traffic, which a weight move or an alias does not have).
GATE_ITEMS = (FREEZE, ERROR_BUDGET)
OVERRIDES_FILE = "gate-overrides.jsonl"


class GateRefused(ServemeshError):
    """A change refused by a freeze window or a spent error budget."""

    exit_code = GATE_REFUSED
    label = "refused"


@dataclass(frozen=True)
class GateReport:
    """What the gates said of one change: every item, those overridden marked."""

    command: str
    models: tuple[str, ...]
    items: tuple[ChecklistItem, ...]

    @property
    def overridden(self) -> list[ChecklistItem]:
        return [item for item in self.items if item.override_reason is not None]

    def lines(self) -> list[str]:
        """One line per overridden gate, for the command's output."""
        return [
            f"gate overridden: {item.name}: {item.detail} (reason: {item.override_reason})"
            for item in self.overridden
        ]


def weights_deploy(before: Mapping[str, int], after: Mapping[str, int]) -> bool:
    """Whether moving a model's weights from `before` to `after` sends traffic somewhere
    new: a version other than the one that served the most gains weight. Moving traffic
    back to that one (a bad canary's share taken away) is the way back, never refused."""
    if not before:
        return any(weight > 0 for weight in after.values())
    top = max(before.values())
    leaders = [version for version, weight in before.items() if weight == top]
    baseline = leaders[0] if len(leaders) == 1 else None
    return any(
        weight > before.get(version, 0) and version != baseline for version, weight in after.items()
    )


def models_rolled_forward(live: MeshSpec, target: MeshSpec) -> list[str]:
    """The models a rollback to `target` deploys something for: weights moved toward
    anything but the version serving the most now, or a shadow started or moved."""
    found = []
    for name, model in target.models.items():
        current = live.models.get(name)
        if current is None:
            continue
        moved = weights_deploy(dict(current.traffic), dict(model.traffic))
        shadow = model.shadow is not None and model.shadow != current.shadow
        if moved or shadow:
            found.append(name)
    return sorted(found)


def models_deployed(plan: ApplyPlan) -> list[str]:
    """The models an apply sends traffic somewhere new for: added models and versions,
    weights moved toward anything but the version that served the most (weights_deploy),
    a shadow started or moved. Removals, scaling, logs and policy are not deploys and pass
    the gates."""
    found = set(plan.added_models) | {model for model, _ in plan.added_versions}
    found |= {m for m, (before, after) in plan.weights.items() if weights_deploy(before, after)}
    found |= {change.what for change in plan.routing if change.kind == "shadow"}
    return sorted(found)


def overrides_from(names: Sequence[str] | None, reasons: Sequence[str] | None) -> dict[str, str]:
    """`--override ITEM` and `--reason TEXT`, paired in order: one reason each, none blank,
    each item a gate of change paths."""
    names, reasons = list(names or []), list(reasons or [])
    if len(names) != len(reasons):
        raise OverrideError(
            f"--override: each needs its own --reason (got {len(names)} overrides and "
            f"{len(reasons)} reasons)"
        )
    unknown = sorted(set(names) - set(GATE_ITEMS))
    if unknown:
        raise OverrideError(
            f"--override: {', '.join(map(repr, unknown))} is no gate of this command; "
            f"gates: {', '.join(GATE_ITEMS)}"
        )
    blank = [name for name, reason in zip(names, reasons, strict=True) if not reason.strip()]
    if blank:
        raise OverrideError(f"--reason for --override {blank[0]}: must not be empty")
    return {name: reason.strip() for name, reason in zip(names, reasons, strict=True)}


def judge(
    spec: ResolvedSpec,
    models: Sequence[str],
    *,
    now: datetime,
    overrides: Mapping[str, str],
) -> list[ChecklistItem]:
    """The freeze gate, and each model's error budget gate (named in its detail), with the
    caller's overrides marked on the failed ones."""
    items = [freeze_item(spec, now=now)]
    for model in sorted(set(models)):
        budget = error_budget_item(spec, model)
        items.append(replace(budget, detail=f"{model}: {budget.detail}"))
    return apply_overrides(items, overrides)


def enforce(
    spec: ResolvedSpec,
    models: Sequence[str],
    *,
    command: str,
    overrides: Mapping[str, str],
    now: datetime | None = None,
) -> GateReport:
    """Judge the gates for a change of `models` by `command`: GateRefused naming each
    failed gate, else the report (the caller records its overrides once the change is
    made: record_if_overridden)."""
    moment = now or datetime.now(UTC)
    if not models:
        # Nothing deployed (the way back, a shadow stopped): no gate to ask.
        return GateReport(command, (), ())
    items = judge(spec, models, now=moment, overrides=overrides)
    report = GateReport(command, tuple(sorted(set(models))), tuple(items))
    blocking = [item for item in items if item.blocks]
    if blocking:
        said = "; ".join(f"{item.name}: {item.detail}" for item in blocking)
        raise GateRefused(
            f"{command}: {said}. Override a gate with --override {blocking[0].name} "
            "--reason TEXT (recorded); moving traffic back to the version serving the most "
            "is never refused"
        )
    return report


def record_if_overridden(state_dir: Path, report: GateReport) -> None:
    """Once the change is made (a change that failed recorded nothing): the overrides it
    took, if any."""
    if report.overridden:
        record_override(state_dir, report, datetime.now(UTC))


def record_override(state_dir: Path, report: GateReport, moment: datetime) -> None:
    """One JSON line per change let through a failed gate: who, when, what, and why."""
    entry = {
        "time": moment.isoformat(timespec="seconds"),
        "unix": round(time.time(), 3),
        "who": operator_name(),
        "command": report.command,
        "models": list(report.models),
        "gates": [
            {"gate": item.name, "detail": item.detail, "reason": item.override_reason}
            for item in report.overridden
        ],
    }
    path = state_dir / OVERRIDES_FILE
    with path.open("a", encoding="utf-8") as file:
        file.write(json.dumps(entry) + "\n")
    path.chmod(0o600)


def read_overrides(state_dir: Path) -> list[dict[str, object]]:
    """Every recorded override, oldest first (none: an empty list)."""
    path = state_dir / OVERRIDES_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
