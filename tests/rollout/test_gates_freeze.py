"""Freeze windows at their edges: a minute before and at a window's start and end, a window
that wraps the week, a holiday in the spec's zone, and the weeks daylight saving time
changes (fixed moments: the functions are pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError

from servemesh.rollout.freeze import active_freeze, freeze_detail
from servemesh.spec.rollout_plan import FreezeSpec, FreezeWindow

BERLIN = ZoneInfo("Europe/Berlin")
SPEC = FreezeSpec(
    timezone="Europe/Berlin",
    weekly=[FreezeWindow(start="fri 15:00", end="mon 09:00", reason="weekend freeze")],
    holidays=["2026-12-24"],
)


def berlin(text: str) -> datetime:
    """A local moment in Berlin, e.g. "2026-12-04 15:00"."""
    return datetime.fromisoformat(text).replace(tzinfo=BERLIN)


@pytest.mark.parametrize(
    ("moment", "frozen"),
    [
        ("2026-12-04 14:59", False),  # Friday, a minute before the start
        ("2026-12-04 15:00", True),  # the start is inside
        ("2026-12-05 12:00", True),  # Saturday
        ("2026-12-06 23:59", True),  # Sunday's last minute
        ("2026-12-07 00:00", True),  # Monday: the window wraps the week's turn
        ("2026-12-07 08:59", True),  # a minute before the end
        ("2026-12-07 09:00", False),  # the end is outside
        ("2026-12-09 12:00", False),  # Wednesday
    ],
)
def test_a_weekly_window_holds_from_its_start_to_just_before_its_end(
    moment: str, frozen: bool
) -> None:
    hit = active_freeze(SPEC, berlin(moment))
    assert (hit is not None) == frozen
    if hit is not None:
        assert hit.kind == "weekly"
        assert hit.starts == berlin("2026-12-04 15:00")
        assert hit.ends == berlin("2026-12-07 09:00")
        assert "weekend freeze (fri 15:00 -> mon 09:00 Europe/Berlin)" in hit.reason


def test_now_is_read_in_the_spec_zone_whatever_zone_it_comes_in() -> None:
    # 14:00 UTC is 15:00 in Berlin in December: the window's first minute.
    assert active_freeze(SPEC, datetime(2026, 12, 4, 14, 0, tzinfo=UTC)) is not None
    assert active_freeze(SPEC, datetime(2026, 12, 4, 13, 59, tzinfo=UTC)) is None
    # Monday 08:30 UTC is 09:30 in Berlin: over.
    assert active_freeze(SPEC, datetime(2026, 12, 7, 8, 30, tzinfo=UTC)) is None


@pytest.mark.parametrize(
    ("moment", "frozen"),
    [
        ("2026-12-23 23:59", False),
        ("2026-12-24 00:00", True),
        ("2026-12-24 23:59", True),
        ("2026-12-25 00:00", False),
    ],
)
def test_a_holiday_is_a_whole_local_day(moment: str, frozen: bool) -> None:
    hit = active_freeze(SPEC, berlin(moment))
    assert (hit is not None) == frozen
    if hit is not None:
        assert hit.kind == "holiday"
        assert hit.reason == "holiday 2026-12-24 (Europe/Berlin)"
        assert hit.ends == berlin("2026-12-25 00:00")


def test_a_holiday_starts_at_local_midnight_not_utc_midnight() -> None:
    # 23:30 UTC on the 23rd is 00:30 on the 24th in Berlin.
    assert active_freeze(SPEC, datetime(2026, 12, 23, 23, 30, tzinfo=UTC)) is not None
    # 23:30 UTC on the 24th is already the 25th in Berlin.
    assert active_freeze(SPEC, datetime(2026, 12, 24, 23, 30, tzinfo=UTC)) is None


def test_a_window_across_the_spring_forward_covers_the_same_wall_clock_minutes() -> None:
    # 2026-03-29: Berlin's clocks jump from 02:00 CET to 03:00 CEST.
    night = FreezeSpec(
        timezone="Europe/Berlin", weekly=[FreezeWindow(start="sun 01:00", end="sun 04:00")]
    )
    assert active_freeze(night, berlin("2026-03-29 00:59")) is None
    assert active_freeze(night, datetime(2026, 3, 29, 0, 59, tzinfo=UTC)) is not None  # 01:59
    inside = active_freeze(night, datetime(2026, 3, 29, 1, 0, tzinfo=UTC))  # 03:00 CEST
    assert inside is not None
    # Three hours on the wall clock, two in real time.
    real = inside.ends.astimezone(UTC) - inside.starts.astimezone(UTC)
    assert real == timedelta(hours=2)
    assert active_freeze(night, datetime(2026, 3, 29, 2, 0, tzinfo=UTC)) is None  # 04:00 CEST


def test_a_weekend_freeze_over_the_fall_back_lasts_an_hour_longer_in_real_time() -> None:
    # 2026-10-25: 03:00 CEST becomes 02:00 CET; 02:30 happens twice.
    first = datetime(2026, 10, 25, 2, 30, fold=0, tzinfo=BERLIN)
    second = datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=BERLIN)
    assert first.utcoffset() != second.utcoffset()
    for moment in (first, second):
        hit = active_freeze(SPEC, moment)
        assert hit is not None
        assert hit.starts.utcoffset() == timedelta(hours=2)  # Friday, summer time
        assert hit.ends.utcoffset() == timedelta(hours=1)  # Monday, winter time
        assert hit.ends.astimezone(UTC) - hit.starts.astimezone(UTC) == timedelta(hours=67)
    # Monday 09:00 CET is 08:00 UTC: the window ends there, not an hour earlier.
    assert active_freeze(SPEC, datetime(2026, 10, 26, 7, 59, tzinfo=UTC)) is not None
    assert active_freeze(SPEC, datetime(2026, 10, 26, 8, 0, tzinfo=UTC)) is None


def test_a_window_within_one_day_and_one_ending_on_a_later_weekday() -> None:
    spec = FreezeSpec(
        weekly=[
            FreezeWindow(start="wed 12:00", end="wed 13:00", reason="lunch"),
            FreezeWindow(start="mon 22:00", end="tue 06:00", reason="night"),
        ]
    )
    assert active_freeze(spec, datetime(2026, 12, 9, 11, 59, tzinfo=UTC)) is None
    lunch = active_freeze(spec, datetime(2026, 12, 9, 12, 30, tzinfo=UTC))
    assert lunch is not None and lunch.reason.startswith("lunch")
    night = active_freeze(spec, datetime(2026, 12, 8, 5, 59, tzinfo=UTC))
    assert night is not None and night.reason.startswith("night")
    assert night.starts == datetime(2026, 12, 7, 22, 0, tzinfo=ZoneInfo("UTC"))
    assert active_freeze(spec, datetime(2026, 12, 8, 6, 0, tzinfo=UTC)) is None


def test_the_checklist_line_names_the_window_and_when_it_ends() -> None:
    ok, detail = freeze_detail(SPEC, berlin("2026-12-05 10:00"))
    assert not ok
    assert detail == (
        "inside weekend freeze (fri 15:00 -> mon 09:00 Europe/Berlin) until "
        "Mon 2026-12-07 09:00 CET (now Sat 2026-12-05 10:00 CET)"
    )
    ok, detail = freeze_detail(SPEC, berlin("2026-12-09 10:00"))
    assert ok and detail.startswith("no freeze holds now (Wed 2026-12-09 10:00 CET; 2 window(s)")
    assert freeze_detail(FreezeSpec(), datetime(2026, 12, 5, tzinfo=UTC)) == (
        True,
        "no freeze windows in the spec",
    )


def test_a_naive_now_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="now: a naive datetime"):
        active_freeze(SPEC, datetime(2026, 12, 5, 10, 0))


def test_bad_windows_and_zones_are_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="end.*same moment as start"):
        FreezeWindow(start="fri 15:00", end="FRI 15:00")
    with pytest.raises(ValidationError, match="start"):
        FreezeWindow(start="friday 15:00", end="mon 09:00")
    with pytest.raises(ValidationError, match="unknown time zone 'Mars/Olympus'"):
        FreezeSpec(timezone="Mars/Olympus")
