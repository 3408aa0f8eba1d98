"""The spec's `batch:` jobs and when each is due.

A job's schedule is a cron expression read in UTC. At a time `now`, its slot is the last
time the schedule fired at or before `now`; the job is due when it never ran, or when its
last recorded run (`<state_dir>/batch/history.jsonl`, the `job` field) started before that
slot. Slots missed while nothing ran are not caught up one by one: the next run covers them
all. A failed run counts as the slot's run (the next slot, or `servemesh batch run JOB`,
tries again), so a job that keeps failing does not run at every call.

The clock is an argument everywhere (`servemesh batch run-due --now ISO`): the tests decide
with times of their choosing and never wait.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from croniter import croniter

from servemesh.batch.history import RunRecord
from servemesh.batch.job import ScoreJob
from servemesh.contract.private import private_dir
from servemesh.spec import BatchJobSpec

LOCKS = Path("batch") / "jobs"


def utc(now: datetime) -> datetime:
    """`now` as an aware UTC time (a naive time is taken as UTC)."""
    return now.replace(tzinfo=UTC) if now.tzinfo is None else now.astimezone(UTC)


def to_ms(when: datetime) -> int:
    return int(utc(when).timestamp() * 1000)


def last_fire(schedule: str, now: datetime) -> datetime:
    """The last time `schedule` fired at or before `now` (whole seconds: cron has minutes)."""
    base = utc(now).replace(microsecond=0) + timedelta(seconds=1)
    fired: datetime = croniter(schedule, base).get_prev(datetime)
    return utc(fired)


def next_fire(schedule: str, now: datetime) -> datetime:
    """The first time `schedule` fires after `now`."""
    fires: datetime = croniter(schedule, utc(now)).get_next(datetime)
    return utc(fires)


@dataclass(frozen=True)
class Decision:
    job: BatchJobSpec
    due: bool
    slot: datetime  # the last time the schedule fired, at or before now
    next_at: datetime  # the next time it fires
    last: RunRecord | None  # the job's last recorded run

    def reason(self) -> str:
        if self.last is None:
            return "never ran"
        last = datetime.fromtimestamp(self.last.started_at_ms / 1000, UTC)
        if self.due:
            return f"last ran {_show(last)}, before the slot of {_show(self.slot)}"
        return f"last ran {_show(last)} ({self.last.status}); next at {_show(self.next_at)}"


def _show(when: datetime) -> str:
    return utc(when).strftime("%Y-%m-%d %H:%M:%S UTC")


def last_run(records: Sequence[RunRecord], job: str) -> RunRecord | None:
    """The job's run that started last (records of other jobs ignored)."""
    mine = [r for r in records if r.job == job]
    return max(mine, key=lambda r: r.started_at_ms) if mine else None


def decide(job: BatchJobSpec, records: Sequence[RunRecord], now: datetime) -> Decision:
    """Whether `job` is due at `now`, given the runs recorded so far."""
    slot = last_fire(job.schedule, now)
    last = last_run(records, job.name)
    due = last is None or last.started_at_ms < to_ms(slot)
    return Decision(job, due, slot, next_fire(job.schedule, now), last)


def score_job(job: BatchJobSpec) -> ScoreJob:
    """The `servemesh batch score` arguments `job` stands for (a fresh run: a run the
    previous one left interrupted is discarded)."""
    return ScoreJob(
        model=job.model,
        out=job.output,
        version=job.version,
        alias=job.alias,
        view=job.view,
        entities=Path(job.entities) if job.entities else None,
        entity_column=job.entity_column,
        table=job.table,
        chunk_rows=job.chunk_rows,
        where=job.where,
    )


@contextmanager
def job_lock(state_dir: Path, name: str) -> Iterator[bool]:
    """Hold the job's lock (`<state_dir>/batch/jobs/<name>.lock`) while the block runs;
    False when another process holds it (a run of the job is under way there): `up`'s
    scheduler and a host's `run-due` never run one job twice at once."""
    folder = state_dir / LOCKS
    private_dir(folder)
    fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


# The batch scheduler process (`python -m servemesh.batch.scheduler`, started by `up`
# when the spec has jobs) writes this file once it runs: the launcher's readiness check.
READY = Path("batch") / "scheduler.ready"


def ready_path(state_dir: Path) -> Path:
    return state_dir / READY
