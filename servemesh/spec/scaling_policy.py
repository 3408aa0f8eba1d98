"""How the mesh's capacity follows its traffic, as the spec states it (`scaling:`): per pool
(each zone's model servers, gateways and feature services), the bounds, the targets the
scaler holds them to, how fast it may move, and calendar floors that raise the minimum
ahead of known peaks.

Everything here is data; the scaler (`servemesh.scaling`) reads it on every round, so an
`apply` that changes it takes effect at the next decision.

    scaling:
      model_servers:
        min: 1
        max: 3
        target: {p99_ms: 100, queue_depth: 8, cpu: 0.7}
        schedule:
          timezone: Europe/Berlin
          floors:
            - {days: [mon, tue, wed, thu, fri], from: "08:45", to: "18:00", min: 2}
      gateway:
        max: 4
        target: {in_flight: 32, cpu: 0.7}
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from servemesh.spec.durations import Duration, duration_seconds
from servemesh.spec.policy import StrictModel

Weekday = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
WEEKDAYS: tuple[Weekday, ...] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_CLOCK = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")


class ScalingTargets(StrictModel):
    """What one replica of the pool may carry; a signal above its target asks for more
    replicas in proportion (twice the target: twice the replicas). A target left out is not
    a signal."""

    # The pool's ModelInfer p99 as its replicas measure it (queue wait included).
    p99_ms: Annotated[float, Field(gt=0)] | None = 100.0
    # Requests waiting in a replica's batch queue, averaged over the pool.
    queue_depth: Annotated[float, Field(gt=0)] | None = 8.0
    # A replica's CPU in cores (1.0: one core busy), averaged over the pool.
    cpu: Annotated[float, Field(gt=0)] | None = 0.7
    # Calls a replica is handling at once (its serving method's, sampled each round),
    # averaged over the pool: the gateways' and feature services' load signal.
    in_flight: Annotated[float, Field(gt=0)] | None = None
    # Failed calls (the SLI's failure codes) as a share of the pool's calls: above it, the
    # pool grows by one step (errors under overload), never in proportion.
    error_ratio: Annotated[float, Field(gt=0, le=1)] | None = None

    @model_validator(mode="after")
    def _one_signal(self) -> ScalingTargets:
        if all(v is None for v in (self.p99_ms, self.queue_depth, self.cpu, self.in_flight)):
            raise ValueError("give at least one of p99_ms, queue_depth, cpu and in_flight")
        return self


def front_targets() -> ScalingTargets:
    """The gateways' and feature services' default targets: their own load (calls in
    flight, CPU). Not their p99: a gateway's Predict p99 holds the feature and model calls
    it waits for, which more gateways would not shorten; and they have no batch queue."""
    return ScalingTargets(p99_ms=None, queue_depth=None, cpu=0.7, in_flight=32.0)


class ScheduleFloor(StrictModel):
    """From `from` to `to` on `days` (local time of the schedule's time zone), the pool
    keeps at least `min` replicas. A `to` at or before `from` runs past midnight."""

    # `from` and `to` in the spec (`from` is a Python keyword here).
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_by_alias=True,
        validate_by_name=True,
        serialize_by_alias=True,
    )

    days: list[Weekday] = Field(default_factory=lambda: list(WEEKDAYS), min_length=1)
    start: str = Field(alias="from")
    end: str = Field(alias="to")
    min: Annotated[int, Field(ge=0, le=16)]

    @field_validator("start", "end")
    @classmethod
    def _clock_time(cls, value: str) -> str:
        if not _CLOCK.fullmatch(value):
            raise ValueError(f"{value!r}: a time of day is HH:MM, 00:00 to 23:59")
        return value


class ScalingSchedule(StrictModel):
    timezone: str = "UTC"
    floors: list[ScheduleFloor] = Field(default_factory=list, max_length=64)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, name: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {name!r}") from None
        return name


# What a replica is taken to carry when neither the spec nor a capacity plan says.
DEFAULT_CAPACITY_RPS = 200.0


class ForecastSpec(StrictModel):
    """Predictive floors (servemesh/scaling/forecast.py): from the prediction log's calls
    per hour, the rate expected `lead` ahead, shared by the scaled zones, over what one
    replica carries, rounded up. The hours are the schedule's time zone's."""

    enabled: bool = False
    lead: Duration = "10m"
    # Calls per second one replica of the pool carries within its targets; null: what
    # `servemesh capacity plan` last measured for the mesh's models (the least of them),
    # else DEFAULT_CAPACITY_RPS.
    capacity_rps: Annotated[float, Field(gt=0)] | None = None
    # How much history the profile averages.
    weeks: Annotated[int, Field(ge=1, le=12)] = 4

    @property
    def lead_s(self) -> float:
        return duration_seconds(self.lead)


class PoolPolicy(StrictModel):
    """One pool's policy, applied to each zone's replicas of it on their own."""

    min: Annotated[int, Field(ge=0, le=16)] = 1
    max: Annotated[int, Field(ge=1, le=16)] = 2
    target: ScalingTargets = Field(default_factory=ScalingTargets)
    # Replicas added (removed) by one decision at most.
    step_up: Annotated[int, Field(ge=1, le=16)] = 1
    step_down: Annotated[int, Field(ge=1, le=16)] = 1
    # A scale-up needs the signals to ask for it over this whole window (a spike shorter than
    # it is ridden out); a scale-in, the signals to allow it over this whole window.
    up_window: Duration = "10s"
    down_window: Duration = "60s"
    # No decision for the pool's zone this long after one of its changes took effect.
    cooldown: Duration = "30s"
    # Scale in only when every signal is under this share of its target (hysteresis: the
    # pool one replica smaller must not breach at once).
    down_below: Annotated[float, Field(gt=0, lt=1)] = 0.5
    # Replicas kept started, loaded and warmed, out of rotation: a scale-up takes these into
    # rotation first (seconds), then starts new standbys. Not counted against `max`.
    standby: Annotated[int, Field(ge=0, le=4)] = 0
    schedule: ScalingSchedule = Field(default_factory=ScalingSchedule)
    forecast: ForecastSpec = Field(default_factory=ForecastSpec)

    @model_validator(mode="after")
    def _bounds(self) -> PoolPolicy:
        if self.min > self.max:
            raise ValueError(f"min: {self.min} is above max {self.max}")
        for index, floor in enumerate(self.schedule.floors):
            if floor.min > self.max:
                raise ValueError(
                    f"schedule.floors[{index}].min: {floor.min} is above max {self.max}"
                )
        return self

    @property
    def up_window_s(self) -> float:
        return duration_seconds(self.up_window)

    @property
    def down_window_s(self) -> float:
        return duration_seconds(self.down_window)

    @property
    def cooldown_s(self) -> float:
        return duration_seconds(self.cooldown)


def front_pool() -> PoolPolicy:
    return PoolPolicy(target=front_targets())


class EdgeSignalSpec(StrictModel):
    """The caller's side (servemesh/scaling/edge.py): Predict as each zone's edge Envoy
    measures it, against the objective below. When it breaches for a pool's `up_window`,
    the pool whose share of the hops grew is scaled, even while every replica's own signals
    are under their targets."""

    enabled: bool = True
    # The caller's p99 and failed share the edge holds the mesh to. A model named in
    # `rollout.slos` makes its own objective apply where it is stricter.
    p99_ms: Annotated[float, Field(gt=0)] = 100.0
    error_ratio: Annotated[float, Field(gt=0, lt=1)] = 0.01


class HostHeadroomSpec(StrictModel):
    """Whether the scaler judges the host (servemesh/scaling/host.py): with `busy_ratio` of
    its CPU busy and a run queue longer than its cores, no signal adds a replica on it, and
    the decision says "no headroom on this host" instead."""

    enabled: bool = True
    busy_ratio: Annotated[float, Field(gt=0, le=1)] = 0.9


class ScalingSpec(StrictModel):
    """The scaler `servemesh up` runs (and `servemesh scale run` runs on its own): a pool
    per kind of replica, each zone's replicas of it scaled on their own."""

    enabled: bool = True
    # How often the scaler reads the signals and decides.
    interval: Duration = "5s"
    # How long a new replica may take to start, load and warm every version.
    ready_timeout: Duration = "120s"
    # How long a draining replica's calls in flight may take before it is stopped anyway
    # (its own drain on SIGTERM then lets them finish within its grace period).
    drain_timeout: Duration = "30s"
    model_servers: PoolPolicy = Field(default_factory=PoolPolicy)
    gateway: PoolPolicy = Field(default_factory=front_pool)
    feature: PoolPolicy = Field(default_factory=front_pool)
    edge: EdgeSignalSpec = Field(default_factory=EdgeSignalSpec)
    host: HostHeadroomSpec = Field(default_factory=HostHeadroomSpec)

    def pool(self, kind: Literal["model", "gateway", "feature"]) -> PoolPolicy:
        """The policy of a kind's pool."""
        return self.model_servers if kind == "model" else getattr(self, kind)

    @property
    def interval_s(self) -> float:
        return duration_seconds(self.interval)

    @property
    def ready_timeout_s(self) -> float:
        return duration_seconds(self.ready_timeout)

    @property
    def drain_timeout_s(self) -> float:
        return duration_seconds(self.drain_timeout)
