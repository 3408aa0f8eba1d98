"""Calendar floors: the least replicas a pool keeps at a moment (`scaling.<pool>.schedule`).

A floor holds from `from` to `to` on its `days`, in the local wall time of the schedule's
time zone (zoneinfo), so "weekdays 08:45" is 08:45 on the clock in Berlin in winter and in
summer alike, and a DST change moves nothing a person would not expect: on the day the clocks
skip 02:00-03:00 a floor from 02:30 starts at 03:00 (the first local time past it), and on
the day they repeat 02:00-03:00 a floor to 02:30 holds in both passes of 02:00-02:30. A `to` at or
before `from` runs past midnight into the next day (`days` names the day it starts).
"""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

from servemesh.spec.scaling_policy import WEEKDAYS, ScalingSchedule, ScheduleFloor


def _active(floor: ScheduleFloor, day: str, previous_day: str, clock: str) -> bool:
    if floor.start < floor.end:
        return day in floor.days and floor.start <= clock < floor.end
    # Past midnight: the evening of a listed day, or the early hours after one.
    return (day in floor.days and clock >= floor.start) or (
        previous_day in floor.days and clock < floor.end
    )


def floor_at(schedule: ScalingSchedule, now: datetime) -> tuple[int, ScheduleFloor | None]:
    """The highest floor holding at `now` (an aware datetime), and the entry that sets it;
    (0, None) when none holds."""
    local = now.astimezone(ZoneInfo(schedule.timezone))
    weekday = local.weekday()
    day, previous_day = WEEKDAYS[weekday], WEEKDAYS[(weekday - 1) % 7]
    clock = local.strftime("%H:%M")
    best: tuple[int, ScheduleFloor | None] = (0, None)
    for floor in schedule.floors:
        if floor.min > best[0] and _active(floor, day, previous_day, clock):
            best = (floor.min, floor)
    return best
