"""The gates of `rollout start` on every other path that changes what a model serves.

A freeze window (`rollout.freeze`) or a model's spent error budget (`rollout.slos`) refuses
a rollout; without this module an operator could do by hand what the rollout was refused:
move the weights (`routes set`), apply a file that adds a version or moves weights
(`apply`), or point an alias at another version (`models alias`). Each of those asks
`enforce` first, with the models it changes, and is refused (exit 4) while a gate fails,
unless the caller overrides that gate with a reason (`--override freeze --reason TEXT`),
which is recorded in `<state_dir>/gate-overrides.jsonl` and printed.

What is never refused: the way back. `routes rollback` returns to a change already made
(the mesh served it before), and an apply that only removes versions or models, scales, or
changes logs takes no traffic anywhere new: neither is a deploy. docs/rollouts-gates.md has
the rules with examples.
"""

from __future__ import annotations

import getpass
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from servemesh.contract.errors import GATE_REFUSED, ServemeshError
from servemesh.proxy.live_plan import ApplyPlan
from servemesh.rollout.checklist import ERROR_BUDGET, FREEZE, OverrideError
from servemesh.rollout.gates import error_budget_item, freeze_item
from servemesh.rollout.types import ChecklistItem
from servemesh.spec import ResolvedSpec

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


def models_deployed(plan: ApplyPlan) -> list[str]:
    """The models an apply sends traffic somewhere new for: added models and versions,
    moved weights, a shadow started or moved. Removals, scaling, logs and policy are not
    deploys and pass the gates."""
    found = set(plan.added_models) | {model for model, _ in plan.added_versions}
    found |= set(plan.weights)
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
        items.append(
            ChecklistItem(name=budget.name, ok=budget.ok, detail=f"{model}: {budget.detail}")
        )
    return [
        ChecklistItem(item.name, item.ok, item.detail, overrides[item.name])
        if not item.ok and item.name in overrides
        else item
        for item in items
    ]


def enforce(
    spec: ResolvedSpec,
    models: Sequence[str],
    *,
    command: str,
    overrides: Mapping[str, str],
    now: datetime | None = None,
) -> GateReport:
    """Judge the gates for a change of `models` by `command`; raise GateRefused naming each
    failed gate, or record the overridden ones and return the report."""
    moment = now or datetime.now(UTC)
    items = judge(spec, models, now=moment, overrides=overrides)
    report = GateReport(command, tuple(sorted(set(models))), tuple(items))
    blocking = [item for item in items if item.blocks]
    if blocking:
        said = "; ".join(f"{item.name}: {item.detail}" for item in blocking)
        raise GateRefused(
            f"{command}: {said}. Override a gate with --override {blocking[0].name} "
            "--reason TEXT (recorded); `servemesh routes rollback` is never refused"
        )
    if report.overridden:
        record_override(Path(spec.state_dir), report, moment)
    return report


def record_override(state_dir: Path, report: GateReport, moment: datetime) -> None:
    """One JSON line per change let through a failed gate: who, when, what, and why."""
    entry = {
        "time": moment.isoformat(timespec="seconds"),
        "unix": round(time.time(), 3),
        "who": _who(),
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


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
