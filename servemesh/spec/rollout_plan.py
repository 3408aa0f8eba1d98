"""What a rollout follows, as the spec states it (`rollout:`): the steps of a canary, the
analysis that judges each step, the checklist's thresholds, the SLOs whose error budget
gates a rollout, and the freeze windows.

Everything here is data; the controller (`servemesh.rollout`) walks it.
A plan given with `servemesh rollout start --plan FILE` replaces `rollout.plan` for that run.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from servemesh.spec.durations import Duration, duration_seconds
from servemesh.spec.policy import StrictModel

Strategy = Literal["canary", "blue-green", "rolling", "shadow-only"]


class RolloutStep(StrictModel):
    """One step: the canary's share of unpinned traffic (or a shadow copy of all of it),
    held for at least `dwell` and until both arms answered `min_requests`."""

    # null: the shadow step, where the canary gets a copy of every call and answers nobody.
    weight: Annotated[int, Field(ge=1, le=100)] | None = None
    dwell: Duration = "30s"
    min_requests: Annotated[int, Field(ge=0)] = 100

    @property
    def shadow(self) -> bool:
        return self.weight is None

    @property
    def dwell_s(self) -> float:
        return duration_seconds(self.dwell)

    @property
    def label(self) -> str:
        return "shadow" if self.weight is None else f"{self.weight}%"


def _default_steps() -> list[RolloutStep]:
    return [RolloutStep(weight=None)] + [RolloutStep(weight=w) for w in (1, 5, 25, 50, 100)]


class AnalysisSpec(StrictModel):
    """How a step is judged: the canary against the baseline over the same window, every
    `interval`. Each limit is relative to the baseline; a check with fewer than
    `min_samples` calls in either arm waits instead of passing or failing."""

    interval: Duration = "10s"
    # The canary's error ratio may exceed the baseline's by at most this many points
    # (0.1 = a tenth of a percentage point).
    max_error_ratio_increase_points: Annotated[float, Field(ge=0, le=100)] = 0.1
    # The canary's p99 latency may be at most this multiple of the baseline's.
    max_p99_ratio: Annotated[float, Field(ge=1.0)] = 1.2
    # ... and only fails when it is also this much slower: at a few milliseconds 1.2x is a
    # fraction of one latency bucket, which no p99 read from buckets resolves.
    p99_slack_ms: Annotated[float, Field(ge=0)] = 10.0
    # Population stability index of the canary's scores against the baseline's.
    max_psi: Annotated[float, Field(gt=0)] = 0.2
    min_samples: Annotated[int, Field(ge=1)] = 100

    @property
    def interval_s(self) -> float:
        return duration_seconds(self.interval)


class ChecklistSpec(StrictModel):
    """Thresholds of the pre-deploy checklist (`servemesh rollout start` prints it)."""

    # Offline metrics the version's registry record must meet, by name: ">=0.8", "<=0.05".
    offline_metrics: dict[str, Annotated[str, Field(pattern=r"^(>=|<=|>|<)-?\d+(\.\d+)?$")]] = (
        Field(default_factory=dict)
    )
    # The canary's p99 on shadow traffic must stay within this SLA (null: the model's SLO p99).
    shadow_p99_ms: Annotated[float, Field(gt=0)] | None = None
    # Scores the canary answers on shadow traffic must be finite, and within this range.
    score_range: tuple[float, float] | None = None


class RolloutPlan(StrictModel):
    strategy: Strategy = "canary"
    steps: list[RolloutStep] = Field(default_factory=_default_steps, min_length=1)
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec)
    checklist: ChecklistSpec = Field(default_factory=ChecklistSpec)
    # A rollout nobody drives (its controller died and nobody ran `resume`) past this long
    # after it started is rolled back by the next command that looks at it.
    deadline: Duration = "2h"

    @property
    def deadline_s(self) -> float:
        return duration_seconds(self.deadline)

    @model_validator(mode="after")
    def _steps_climb_to_full(self) -> RolloutPlan:
        weights = [s.weight for s in self.steps if s.weight is not None]
        if any(s.shadow for s in self.steps[1:]) and not self.steps[0].shadow:
            raise ValueError("steps: a shadow step may only come first")
        if sum(1 for s in self.steps if s.shadow) > 1:
            raise ValueError("steps: at most one shadow step")
        if weights != sorted(set(weights)):
            raise ValueError(f"steps: weights must rise, got {weights}")
        if self.strategy == "canary" and (not weights or weights[-1] != 100):
            raise ValueError("steps: a canary's last step gives the new version 100")
        return self


class SloSpec(StrictModel):
    """A model's service level objective, measured at the gateway over `window`."""

    availability: Annotated[float, Field(gt=0, lt=1)] = 0.999
    p99_ms: Annotated[float, Field(gt=0)] = 250.0
    window: Duration = "30d"

    @property
    def window_s(self) -> float:
        return duration_seconds(self.window)


_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
WeeklyMoment = Annotated[
    str, Field(pattern=r"^(?i:mon|tue|wed|thu|fri|sat|sun) ([01]\d|2[0-3]):[0-5]\d$")
]


class FreezeWindow(StrictModel):
    """A weekly window in which rollouts are refused, e.g. from "fri 15:00" to "mon 09:00"."""

    start: WeeklyMoment
    end: WeeklyMoment
    reason: str = "weekly freeze"

    @model_validator(mode="after")
    def _not_empty(self) -> FreezeWindow:
        # An end before the start wraps the week (fri -> mon); an equal one would be either
        # nothing or the whole week, so it is refused rather than guessed.
        if _clock(self.start) == _clock(self.end):
            raise ValueError(f"end: {self.end!r} is the same moment as start {self.start!r}")
        return self


class FreezeSpec(StrictModel):
    timezone: str = "UTC"
    weekly: list[FreezeWindow] = Field(default_factory=list)
    # Whole days (YYYY-MM-DD, in `timezone`) in which rollouts are refused.
    holidays: list[Annotated[str, Field(pattern=r"^\d{4}-\d{2}-\d{2}$")]] = Field(
        default_factory=list
    )

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, name: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {name!r}") from None
        return name


class RolloutSpec(StrictModel):
    plan: RolloutPlan = Field(default_factory=RolloutPlan)
    # Per model; a model without an entry has no error-budget gate.
    slos: dict[str, SloSpec] = Field(default_factory=dict)
    freeze: FreezeSpec = Field(default_factory=FreezeSpec)


def _clock(moment: str) -> tuple[int, str]:
    return weekday_index(moment), moment.split()[1]


def weekday_index(moment: str) -> int:
    """0 for Monday ... 6 for Sunday, from a WeeklyMoment."""
    return _WEEKDAYS.index(moment.split()[0].lower())
