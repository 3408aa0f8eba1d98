"""Predictive floors from a synthetic history: three weeks with a daily 09:00-11:00 peak,
the floor raised `lead` before the peak (not after it), a hotter week raising the forecast
by its trend, and hours of the week kept in local time across DST."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from servemesh.scaling.decide import PoolSignals, Stabilizer, decide
from servemesh.scaling.forecast import forecast, hour_of_week
from servemesh.spec.scaling_policy import PoolPolicy

MONDAY = datetime(2026, 11, 30, tzinfo=UTC)
PEAK_RPS, QUIET_RPS = 500.0, 10.0


def weeks_of_history(
    end: datetime, weeks: int = 3, scale: float = 1.0
) -> list[tuple[datetime, int]]:
    hours = []
    at = end - timedelta(weeks=weeks)
    while at < end:
        rps = PEAK_RPS if 9 <= at.hour < 11 else QUIET_RPS
        hours.append((at, int(rps * scale * 3600)))
        at += timedelta(hours=1)
    return hours


def test_the_floor_rises_before_the_peak_not_after() -> None:
    history = weeks_of_history(MONDAY)
    pool = PoolPolicy.model_validate(
        {"min": 1, "max": 4, "forecast": {"enabled": True, "lead": "10m", "capacity_rps": 100}}
    )
    stable, replicas, first_up = Stabilizer(), 1, None
    for minute in range(8 * 60, 10 * 60):
        now = MONDAY + timedelta(minutes=minute)
        expected = forecast(history, now + timedelta(minutes=10), now, ZoneInfo("UTC"))
        floor = expected.replicas(zones=2, capacity_rps=100)
        found = decide(
            "zone-a",
            pool,
            PoolSignals(replicas=replicas, p99_ms=5.0),  # the peak's load has not come yet
            stable,
            minute * 60.0,
            now,
            (floor, f"forecast {expected.rps:.0f} req/s"),
        )
        if found.changes and first_up is None:
            first_up = (now, found.current, found.desired, found.reason)
            replicas = found.desired
            stable.changed(minute * 60.0)
    assert first_up is not None
    at, before, after, why = first_up
    assert (at.hour, at.minute) == (8, 50)  # lead 10 m before 09:00
    assert (before, after) == (1, 3)  # 500 req/s over 2 zones at 100 a replica: 3 each
    assert why == "forecast 500 req/s"


def test_a_hotter_week_raises_the_forecast_by_its_trend() -> None:
    now = MONDAY + timedelta(hours=8)
    history = weeks_of_history(MONDAY) + [
        (MONDAY + timedelta(hours=h), int(QUIET_RPS * 1.3 * 3600)) for h in range(8)
    ]
    expected = forecast(history, now + timedelta(hours=1), now, ZoneInfo("UTC"))
    assert expected.profile_rps == pytest.approx(PEAK_RPS, rel=0.01)
    assert expected.trend == pytest.approx(1.3, rel=0.05)
    assert expected.rps == pytest.approx(PEAK_RPS * expected.trend)
    # No history at all: nothing expected, one replica.
    empty = forecast([], now, now, ZoneInfo("UTC"))
    assert (empty.rps, empty.replicas(2, 100.0)) == (0.0, 1)


def test_hours_of_the_week_are_local_wall_hours_across_dst() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    winter = datetime(2026, 1, 12, 8, 30, tzinfo=UTC)  # monday 09:30 CET
    summer = datetime(2026, 7, 13, 7, 30, tzinfo=UTC)  # monday 09:30 CEST
    assert hour_of_week(winter, berlin) == hour_of_week(summer, berlin) == 9
