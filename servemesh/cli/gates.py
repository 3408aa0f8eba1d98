"""How a change command shows what the gates let through (servemesh.rollout.change_gates)."""

from __future__ import annotations

from servemesh.cli.output import console
from servemesh.rollout.change_gates import GateReport


def report_gates(report: GateReport) -> None:
    """One line on stderr per overridden gate: the change goes ahead, and says so."""
    for line in report.lines():
        console.print(line, style="yellow", markup=False, highlight=False)


def overridden_reason(report: GateReport) -> str | None:
    """What the routes history records of the overrides (None: none)."""
    if not report.overridden:
        return None
    return "gates overridden: " + "; ".join(
        f"{item.name}: {item.override_reason}" for item in report.overridden
    )
