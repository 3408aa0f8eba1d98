"""The values the rollout's parts hand each other: what an arm did in a window, what a check
concluded, and how a rollout ended. Plain data, so each part is testable on its own."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from servemesh.contract.errors import GATE_REFUSED, OK, REFUSED, ROLLED_BACK

Verdict = Literal["pass", "fail", "wait"]


@dataclass(frozen=True)
class ArmWindow:
    """One version's calls over an analysis window (a difference of two counter snapshots).

    `latency_buckets` and `score_buckets` are cumulative-free counts per bucket, the bucket
    upper bounds in `latency_bounds_s` / `score_bounds` (the last bound is +inf)."""

    version: str
    requests: int
    errors: int
    latency_bounds_s: tuple[float, ...] = ()
    latency_buckets: tuple[int, ...] = ()
    score_bounds: tuple[float, ...] = ()
    score_buckets: tuple[int, ...] = ()

    @property
    def error_ratio(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class Check:
    """One conclusion about one step: a named check (error_ratio, p99, psi, ...) and why."""

    name: str
    verdict: Verdict
    detail: str


@dataclass(frozen=True)
class ChecklistItem:
    """One line of the pre-deploy checklist or a gate (freeze, error budget)."""

    name: str
    ok: bool
    detail: str
    # Set when a failed item was let through with `--override NAME --reason TEXT`.
    override_reason: str | None = None

    @property
    def blocks(self) -> bool:
        return not self.ok and self.override_reason is None


class Outcome(enum.IntEnum):
    """How `servemesh rollout start|resume` ends: its exit status (servemesh/contract/errors.py)."""

    PROMOTED = OK
    FAILED = REFUSED  # an error of the command itself (bad arguments, a bad plan)
    ROLLED_BACK = ROLLED_BACK
    REFUSED = GATE_REFUSED  # a gate, the checklist, a rollout already under way


@dataclass(frozen=True)
class Ending:
    outcome: Outcome
    reason: str
    checks: tuple[Check, ...] = field(default=())
