"""The controller's side of a rollout's durable state (servemesh.state.rollouts): its own
values (checks, arm windows, checklist items) as the records the state file holds, and back.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from servemesh.rollout.types import ArmWindow, Check, ChecklistItem
from servemesh.state.rollouts import CheckRecord, WindowRecord


def check_record(check: Check) -> CheckRecord:
    return CheckRecord(name=check.name, verdict=check.verdict, detail=check.detail)


def window_record(window: ArmWindow) -> WindowRecord:
    return WindowRecord(**asdict(window))


def arm_of(record: WindowRecord) -> ArmWindow:
    return ArmWindow(**record.model_dump())


def checklist_record(items: list[ChecklistItem]) -> list[dict[str, Any]]:
    return [asdict(item) for item in items]
