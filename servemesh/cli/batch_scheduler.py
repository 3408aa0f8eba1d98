"""`python -m servemesh.cli.batch_scheduler --state-dir D`: the spec's `batch:` jobs, run by
`servemesh up` when they are due (the process `up` starts when the spec has jobs).

It does what `servemesh batch run-due` does, at every time a job's schedule fires: the same
decision, the same per-job lock (so a host's own `run-due` never runs a job twice at once),
the same record in the history. It runs at a lower CPU priority (nice +10) than the mesh's
services, in a process of its own: a run's forward passes yield the cores to online
serving, and a run that fails or runs out of memory takes nothing else down. The spec is
read again before every round, so jobs an `apply` changed take effect at their next slot.
SIGTERM ends it; a run in flight is left interrupted (its output never half there) and the
job's next run starts afresh.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servemesh.cli.batch_scheduler")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    state_dir = Path(args.state_dir)

    from servemesh.batch.schedule import READY, next_fire, ready_path
    from servemesh.cli.batch import run_due
    from servemesh.cli.mesh import RunningMesh
    from servemesh.private import private_dir
    from servemesh.proxy.apply import MeshPaths

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
        spec = MeshPaths(state_dir).running_spec()
        if not spec.batch:
            stop.wait()
            break
        running.set()
        try:
            failed = run_due(RunningMesh(state_dir, spec), None)
        finally:
            running.clear()
        if failed:
            log.warning("%d batch job(s) failed; each runs again at its next slot", failed)
        now = datetime.now(UTC)
        wake = min(next_fire(job.schedule, now) for job in spec.batch)
        log.info("next batch slot at %s", wake.isoformat())
        stop.wait(max(0.0, (wake - now).total_seconds()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
