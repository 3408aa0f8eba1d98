"""Predictive floors: the request rate expected a little ahead, from the past weeks' rate at
the same hour of the week, so a pool grows before a known peak rather than after it.

The model is an hour-of-week profile with a trend, on purpose small and explainable:

- the profile: for each hour of the week (local time of the schedule's time zone, so a
  09:00 peak stays at 09:00 across DST), the mean calls per second of that hour over the
  history (the prediction log's calls per hour, `weeks` weeks of it);
- the trend: how the last `TREND_HOURS` complete hours compare with the profile's values
  for them (actual / expected, clamped to [0.5, 2]; the profile leaves those hours out), so
  a week running 30% hotter than usual raises the whole forecast by as much;
- the forecast for a time: its hour's profile value times the trend.

Why not a forecasting package (statsforecast, prophet): the signal is one weekly season plus
a level, which this captures; the packages add a model fit per round and large
dependencies (prophet builds with cmdstan) for no accuracy a replica count would notice.

The floor it gives: the forecast `lead` ahead, shared evenly by the scaled zones, over what
one replica carries (`forecast.capacity_rps`, else what `servemesh capacity plan` last
measured: `replica_capacity`), rounded up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

HOUR_S = 3600.0
TREND_HOURS = 3
TREND_BOUNDS = (0.5, 2.0)


def hour_of_week(at: datetime, zone: ZoneInfo) -> int:
    """0 for Monday 00:00-01:00 local, ... 167 for Sunday 23:00-24:00."""
    local = at.astimezone(zone)
    return local.weekday() * 24 + local.hour


@dataclass(frozen=True)
class Forecast:
    at: datetime
    rps: float  # calls per second expected at `at`
    profile_rps: float  # the hour of week's mean, before the trend
    trend: float
    hours_seen: int  # how many past hours of the same hour of week the profile averaged

    def replicas(self, zones: int, capacity_rps: float) -> int:
        """The replicas per zone it asks for (at least one)."""
        return max(1, math.ceil(self.rps / max(1, zones) / capacity_rps))


def profile(hourly: Sequence[tuple[datetime, int]], zone: ZoneInfo) -> dict[int, tuple[float, int]]:
    """Hour of week -> (mean calls per second, hours averaged), from calls per hour."""
    sums: dict[int, list[float]] = {}
    for at, calls in hourly:
        sums.setdefault(hour_of_week(at, zone), []).append(calls / HOUR_S)
    return {h: (sum(v) / len(v), len(v)) for h, v in sums.items()}


def forecast(
    hourly: Sequence[tuple[datetime, int]], at: datetime, now: datetime, zone: ZoneInfo
) -> Forecast:
    """The rate expected at `at` (after `now`), from calls per hour up to `now`."""
    past = [(t, n) for t, n in hourly if t + timedelta(hours=1) <= now]
    # The profile leaves the trend's hours out: they are what it is compared with.
    recent = past[-TREND_HOURS:]
    shape = profile(past[:-TREND_HOURS] or past, zone)
    expected, seen = shape.get(hour_of_week(at, zone), (0.0, 0))
    actual = sum(n for _, n in recent) / HOUR_S
    usual = sum(shape.get(hour_of_week(t, zone), (0.0, 0))[0] for t, _ in recent)
    trend = 1.0
    if usual > 0 and recent:
        trend = min(max(actual / usual, TREND_BOUNDS[0]), TREND_BOUNDS[1])
    return Forecast(at=at, rps=expected * trend, profile_rps=expected, trend=trend, hours_seen=seen)


def replica_capacity(spec: Any, state_dir: str | Path) -> tuple[float, str]:
    """Calls/s one model server is taken to carry, and where the figure comes from: the
    policy's `capacity_rps`, else the last capacity plan of the spec's models, else
    DEFAULT_CAPACITY_RPS."""
    from servemesh.capacity.plan import measured_model_capacity
    from servemesh.spec.scaling_policy import DEFAULT_CAPACITY_RPS

    given = spec.scaling.model_servers.forecast.capacity_rps
    if given is not None:
        return float(given), "the spec's"
    measured = measured_model_capacity(state_dir, sorted(spec.models))
    if measured is not None:
        return measured, "measured by capacity plan"
    return DEFAULT_CAPACITY_RPS, "the default"
