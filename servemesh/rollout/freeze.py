"""Deploy freezes: is a rollout refused right now because a freeze window holds?

Pure functions of the spec's `rollout.freeze` (FreezeSpec) and an aware datetime, so every
edge (a window's first and last minute, a window that wraps the week, a holiday, a change
of daylight saving time) is testable with fixed moments.

Weekly windows are wall-clock times in the spec's time zone: "fri 15:00" is 15:00 on the
local clock whether the offset is +01:00 or +02:00 that week. A window holds from its start
(inclusive) to its end (exclusive); an end at or before its start on the week's clock wraps
over the week's turn (fri 15:00 -> mon 09:00 holds all weekend). Holidays are whole local
days, midnight to midnight. The local clock comes from zoneinfo, so a DST change inside a
window only changes how many real hours the window lasts, never which minutes it covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, time, timedelta
from typing import Literal
from zoneinfo import ZoneInfo

from servemesh.spec.rollout_plan import FreezeSpec, FreezeWindow, weekday_index

MINUTES_PER_WEEK = 7 * 24 * 60


@dataclass(frozen=True)
class FreezeHit:
    """The freeze that holds at a moment: which one, why, and when it began and ends
    (local, aware datetimes in the spec's zone)."""

    kind: Literal["weekly", "holiday"]
    reason: str
    starts: datetime
    ends: datetime

    def describe(self) -> str:
        """One line, e.g. "weekly freeze (fri 15:00 -> mon 09:00 Europe/Berlin) until
        Mon 2026-12-07 09:00 CET"."""
        return f"{self.reason} until {_stamp(self.ends)}"


def _stamp(moment: datetime) -> str:
    return moment.strftime("%a %Y-%m-%d %H:%M %Z")


def _minute_of_week(moment: str) -> int:
    """Minutes since Monday 00:00 of a WeeklyMoment ("fri 15:00")."""
    clock = moment.split()[1]
    hours, minutes = (int(part) for part in clock.split(":"))
    return weekday_index(moment) * 24 * 60 + hours * 60 + minutes


def _local(now: datetime, zone: ZoneInfo) -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("now: a naive datetime; pass an aware one (e.g. datetime.now(UTC))")
    return now.astimezone(zone)


def weekly_hit(window: FreezeWindow, now: datetime, zone: ZoneInfo) -> FreezeHit | None:
    """The window, if it holds at `now` (start inclusive, end exclusive, wrapping the week
    when its end is at or before its start)."""
    local = _local(now, zone)
    here = local.weekday() * 24 * 60 + local.hour * 60 + local.minute
    start, end = _minute_of_week(window.start), _minute_of_week(window.end)
    # Minutes since the window last started, and how long it lasts, on the week's clock.
    since_start = (here - start) % MINUTES_PER_WEEK
    length = (end - start) % MINUTES_PER_WEEK or MINUTES_PER_WEEK
    if since_start >= length:
        return None
    # Wall-clock arithmetic on the naive local time, then the zone attached: the window
    # covers the same minutes of the local clock whatever the offsets on either side.
    wall_now = local.replace(tzinfo=None, second=0, microsecond=0)
    wall_start = wall_now - timedelta(minutes=since_start)
    starts = wall_start.replace(tzinfo=zone)
    ends = (wall_start + timedelta(minutes=length)).replace(tzinfo=zone)
    return FreezeHit(
        kind="weekly",
        reason=f"{window.reason} ({window.start} -> {window.end} {zone.key})",
        starts=starts,
        ends=ends,
    )


def holiday_hit(spec: FreezeSpec, now: datetime) -> FreezeHit | None:
    """The holiday that `now` falls on in the spec's zone, if any (whole local days)."""
    zone = ZoneInfo(spec.timezone)
    today = _local(now, zone).date()
    if today.isoformat() not in spec.holidays:
        return None
    return FreezeHit(
        kind="holiday",
        reason=f"holiday {today.isoformat()} ({zone.key})",
        starts=datetime.combine(today, time(), tzinfo=zone),
        ends=datetime.combine(today + timedelta(days=1), time(), tzinfo=zone),
    )


def active_freeze(spec: FreezeSpec, now: datetime) -> FreezeHit | None:
    """The freeze that holds at `now`, if any: a holiday first (it names the day), then the
    first weekly window of the spec that holds."""
    zone = ZoneInfo(spec.timezone)
    hit = holiday_hit(spec, now)
    if hit is not None:
        return hit
    for window in spec.weekly:
        hit = weekly_hit(window, now, zone)
        if hit is not None:
            return hit
    return None


def freeze_detail(spec: FreezeSpec, now: datetime) -> tuple[bool, str]:
    """(no freeze holds, one line for the checklist)."""
    hit = active_freeze(spec, now)
    local = _local(now, ZoneInfo(spec.timezone))
    if hit is not None:
        return False, f"inside {hit.describe()} (now {_stamp(local)})"
    if not spec.weekly and not spec.holidays:
        return True, "no freeze windows in the spec"
    count = len(spec.weekly) + len(spec.holidays)
    return True, f"no freeze holds now ({_stamp(local)}; {count} window(s) in the spec)"
