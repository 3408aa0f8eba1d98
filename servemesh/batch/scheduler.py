"""The spec's `batch:` jobs run when due: a round over them (`servemesh batch run-due`), and
the process `servemesh up` starts to run its rounds when the spec has jobs
(`python -m servemesh.batch.scheduler --state-dir D`).

The process does what `servemesh batch run-due` does, at every time a job's schedule fires:
the same decision, the same per-job lock (so a host's own `run-due` never runs a job twice
at once), the same record in the history. It runs at a lower CPU priority (nice +10) than
the mesh's services, in a process of its own: a run's forward passes yield the cores to
online serving, and a run that fails or runs out of memory takes nothing else down. The
spec is read again before every round, so jobs an `apply` changed take effect at their next
slot. SIGTERM ends it; a run in flight is left interrupted (its output never half there)
and the job's next run starts afresh.

It finds the running mesh (its resolved spec) through the state dir
(servemesh.state.running), as every command does.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servemesh.batch.job import Progress
    from servemesh.state.running import RunningMesh

log = logging.getLogger(__name__)


class Report:
    """What a round says as it goes: a line per job on stdout (due or not, what it
    scored), failures and notes on stderr, and no progress. The command line passes one
    that prints through its consoles and shows progress."""

    def say(self, line: str) -> None:
        print(line, flush=True)

    def warn(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def progress(self) -> AbstractContextManager[Progress | None]:
        """Around each job's run: what it reports its rows to, if anything."""
        return nullcontext()


def run_due(mesh: RunningMesh, now: datetime | None, report: Report | None = None) -> int:
    """Run every spec job due at `now` (the real time when None), one after another; the
    number that failed. A job whose lock another process holds is left to it."""
    from servemesh.batch.history import read_history
    from servemesh.batch.runs import DISCARDED, run_job, summary
    from servemesh.batch.schedule import decide, job_lock

    report = report or Report()
    failed = 0
    for job_spec in mesh.spec.batch:
        when = now or datetime.now(UTC)
        decision = decide(job_spec, read_history(mesh.state_dir, job_spec.name), when)
        if not decision.due:
            report.say(f"{job_spec.name}: not due ({decision.reason()})")
            continue
        with job_lock(mesh.state_dir, job_spec.name) as held:
            if not held:
                report.say(f"{job_spec.name}: running in another process")
                continue
            # Another process may have run it between the first look and the lock.
            when = now or datetime.now(UTC)
            decision = decide(job_spec, read_history(mesh.state_dir, job_spec.name), when)
            if not decision.due:
                report.say(f"{job_spec.name}: not due ({decision.reason()})")
                continue
            report.say(f"{job_spec.name}: due ({decision.reason()})")
            try:
                with report.progress() as progress:
                    result = run_job(mesh, job_spec, now, progress)
            except Exception as exc:
                failed += 1
                report.warn(f"{job_spec.name}: failed: {exc}")
                continue
            if result.discarded_leftover:
                report.warn(DISCARDED)
            report.say(f"{job_spec.name}: {summary(result)}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servemesh.batch.scheduler")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    state_dir = Path(args.state_dir)

    from servemesh.batch.schedule import READY, next_fire, ready_path
    from servemesh.contract.private import private_dir
    from servemesh.state.running import RunningMesh

    stop = threading.Event()
    running = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()
        if running.is_set():
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    os.nice(10)
    private_dir((state_dir / READY).parent)
    ready_path(state_dir).write_text(f"{os.getpid()}\n")
    while not stop.is_set():
        mesh = RunningMesh.at(state_dir)
        if not mesh.spec.batch:
            stop.wait()
            break
        running.set()
        try:
            failed = run_due(mesh, None)
        finally:
            running.clear()
        if failed:
            log.warning("%d batch job(s) failed; each runs again at its next slot", failed)
        now = datetime.now(UTC)
        wake = min(next_fire(job.schedule, now) for job in mesh.spec.batch)
        log.info("next batch slot at %s", wake.isoformat())
        stop.wait(max(0.0, (wake - now).total_seconds()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
