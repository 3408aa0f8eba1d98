"""`servemesh batch score|run-due|run|history|plan-tiers`: batch prediction with the
registry's verified artifact over a feature view (docs/batch.md)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from servemesh.batch.scheduler import Report, run_due
from servemesh.cli import plan_tiers
from servemesh.cli.flags import add_output, deprecated
from servemesh.cli.mesh import add_mesh_flags, recorded_state_dir, running_mesh
from servemesh.cli.output import console, out, write

if TYPE_CHECKING:
    from servemesh.batch.history import RunRecord
    from servemesh.batch.job import ScoreJob, ScoreResult


@contextmanager
def _progress(mode: str) -> Iterator[Callable[[int, int], None] | None]:
    """rows/s and ETA on stderr: a bar on a terminal, a line per chunk with `lines`."""
    if mode == "off" or (mode == "auto" and not console.is_terminal):
        yield None
        return
    if mode == "lines":
        started = time.perf_counter()

        def line(done: int, total: int) -> None:
            elapsed = time.perf_counter() - started
            rate = f"{done / elapsed:,.0f} ids/s" if elapsed > 0 and done else ""
            console.print(f"scored {done:,}/{total:,} ids {rate}", markup=False)

        yield line
        return
    bar = Progress(
        TextColumn("scoring"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("ids  {task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task("score", total=None, rate="")
    first: list[float] = []

    def update(done: int, total: int) -> None:
        now = time.perf_counter()
        if not first:
            first.append(now)
            first.append(done)
        elapsed = now - first[0]
        rate = f"{(done - first[1]) / elapsed:,.0f} ids/s" if elapsed > 0 else ""
        bar.update(task, completed=done, total=total, rate=rate)

    with bar:
        yield update


def _job(args: argparse.Namespace) -> ScoreJob:
    from servemesh.batch.job import ScoreJob

    return ScoreJob(
        model=args.model,
        out=args.out,
        version=args.version,
        alias=args.alias,
        view=args.view,
        entities=Path(args.entity_ids) if args.entity_ids else None,
        entity_column=args.entity_column,
        table=args.table,
        chunk_rows=args.chunk_rows,
        batch_size=args.batch_size,
        where=args.where,
        resume=args.resume,
        engine=args.engine,
        scheduler=args.scheduler,
        workers=args.workers,
        through_mesh=args.through_mesh,
        greedy=args.greedy,
    )


def cmd_score(args: argparse.Namespace) -> int:
    from servemesh.batch.runs import run_recorded

    mesh = running_mesh(args)
    job = _job(args)
    args.interrupted = "the checkpoint is kept; the same command with --resume continues it"
    if job.through_mesh:
        # Through the mesh, this process (its Redis reads, the requests it encodes) shares
        # the mesh's cores with online serving: it yields them, as the batch scheduler
        # does, on top of the lowest batcher priority its calls carry.
        os.nice(10)
    with _progress(args.progress) as progress:
        result = run_recorded(mesh, "", job, threads=args.threads, progress=progress)
    summary(result)
    return 0


def summary(result: ScoreResult) -> None:
    """What a finished run says: a note on stderr when it discarded an interrupted run,
    then its line on stdout."""
    from servemesh.batch.runs import DISCARDED
    from servemesh.batch.runs import summary as summary_line

    if result.discarded_leftover:
        console.print(DISCARDED, markup=False)
    out.print(summary_line(result), markup=False)


class _Report(Report):
    """A round of due jobs as the command prints it: through the command's consoles, with
    the progress `--progress` asks for."""

    def __init__(self, progress_mode: str) -> None:
        self.progress_mode = progress_mode

    def say(self, line: str) -> None:
        out.print(line, markup=False)

    def warn(self, line: str) -> None:
        console.print(line, markup=False)

    def progress(self) -> AbstractContextManager[Callable[[int, int], None] | None]:
        return _progress(self.progress_mode)


def _parse_now(text: str | None) -> datetime | None:
    from servemesh.batch.errors import BatchError
    from servemesh.batch.schedule import utc

    if text is None:
        return None
    try:
        return utc(datetime.fromisoformat(text))
    except ValueError:
        raise BatchError(
            f"--now {text}: not an ISO 8601 time (e.g. 2026-05-01T02:00:00Z)"
        ) from None


def cmd_run_due(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    now = _parse_now(args.now)
    if not mesh.spec.batch:
        out.print("no batch jobs in the spec", markup=False)
        return 0
    return 1 if run_due(mesh, now, _Report(args.progress)) else 0


def cmd_run(args: argparse.Namespace) -> int:
    from servemesh.batch.errors import BatchError
    from servemesh.batch.runs import run_job
    from servemesh.contract.errors import ServemeshError

    mesh = running_mesh(args)
    try:
        job_spec = mesh.spec.batch_job(args.job)
    except ServemeshError as exc:
        raise BatchError(str(exc)) from None
    args.interrupted = "the next run of the job starts afresh"
    now = _parse_now(args.now)
    with _progress(args.progress) as progress:
        result = run_job(mesh, job_spec, now, progress)
    summary(result)
    return 0


def _finished(r: RunRecord) -> datetime:
    return datetime.fromtimestamp(r.finished_at_ms / 1000, UTC)


def _history_row(r: RunRecord) -> dict[str, object]:
    """A run as the history table shows it: its sha256 whole and its error apart."""
    return {
        "finished": _finished(r).isoformat().replace("+00:00", "Z"),
        "job": r.job or None,
        "model": r.model,
        "version": r.version,
        "sha256": r.sha256,
        "rows": r.rows,
        "seconds": r.seconds,
        "status": r.status,
        "error": r.error,
        "output": r.output,
    }


def cmd_history(args: argparse.Namespace) -> int:
    from servemesh.batch.history import read_history

    state_dir = recorded_state_dir(args, "batch")
    records = read_history(state_dir, args.job)[-args.limit :]
    if args.json:
        write(json.dumps([_history_row(r) for r in records]))
        return 0
    if not records:
        out.print("no batch runs recorded", markup=False)
        return 0
    table = Table(box=None, pad_edge=False)
    for column in ("finished", "job", "model", "version", "sha256", "rows", "seconds",
                   "status", "output"):  # fmt: skip
        table.add_column(column, justify="right" if column in ("rows", "seconds") else "left")
    for r in records:
        when = _finished(r).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            when, r.job or "-", r.model, r.version, r.sha256[:12], f"{r.rows:,}",
            f"{r.seconds:.2f}", r.status if not r.error else f"{r.status}: {r.error[:80]}",
            r.output,
        )  # fmt: skip
    out.print(table)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    batch = sub.add_parser("batch", help="batch prediction: score a feature view in bulk")
    add_mesh_flags(batch)
    verbs = batch.add_subparsers(dest="verb", required=True)
    s = verbs.add_parser(
        "score",
        help="score every entity of a view (or the ids in a file) into Parquet, "
        "PostgreSQL or Redis",
        description="Runs in this process (or, with --engine dask, chunk by chunk on a Dask "
        "cluster) with the registry's verified artifact and the online store's rows: one row "
        "per entity (its id, every output, model, version, "
        "sha256, scored_at). The output is complete or not there; Ctrl-C or a crash leaves a "
        "checkpoint that --resume continues from.",
    )
    s.add_argument("--model", required=True, help="the model (a model of the running spec)")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--version", help="the version (default: the one most traffic goes to)")
    which.add_argument("--alias", help="a registry alias naming the version")
    source = s.add_mutually_exclusive_group()
    source.add_argument("--view", help="score every entity of this view (default: the model's)")
    source.add_argument("--entity-ids", help="score the ids in this CSV or Parquet file")
    deprecated(source, "--entities", "--entity-ids", dest="entity_ids")
    s.add_argument("--entity-column", help="the --entity-ids column (default: the entity's name)")
    s.add_argument(
        "--out",
        required=True,
        help="FILE.parquet, redis (the mesh's, docs/batch.md's key layout) or postgresql://...",
    )
    s.add_argument("--table", help="the PostgreSQL table (default: <model>_scores)")
    s.add_argument("--resume", action="store_true", help="continue an interrupted run")
    s.add_argument(
        "--chunk-rows",
        type=int,
        default=16_384,
        help="rows per chunk: the unit read, written and checkpointed (default 16384)",
    )
    s.add_argument(
        "--batch-size",
        type=int,
        default=1024,
        help="rows per call of the model (default 1024); a chunk is scored as its batches",
    )
    s.add_argument(
        "--through-mesh",
        action="store_true",
        help="score with the running mesh's model servers (OIP ModelInfer at the model's "
        "lowest batcher priority, so online calls go first) instead of in this process",
    )
    s.add_argument(
        "--greedy",
        action="store_true",
        help="--through-mesh: keep every request the run may have in flight however busy "
        "the mesh is (by default the run gives way while its calls slow down: online "
        "traffic needs the model servers)",
    )
    s.add_argument("--where", help='score only rows that pass, e.g. "event_ts > 2024-05-01"')
    s.add_argument(
        "--progress",
        choices=["auto", "lines", "off"],
        default="auto",
        help="auto: a bar on a terminal; lines: a line per chunk on stderr",
    )
    s.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    s.add_argument(
        "--engine",
        choices=["process", "dask"],
        default="process",
        help="process: score in this process; dask: each chunk a task on a Dask cluster "
        "(docs/batch.md)",
    )
    s.add_argument(
        "--scheduler",
        help="--engine dask: the cluster's scheduler, e.g. tcp://10.0.0.5:8786 (default: a "
        "local cluster started and closed by the command)",
    )
    s.add_argument(
        "--workers",
        type=int,
        help="--engine dask: worker processes of the local cluster (default 2)",
    )
    add_mesh_flags(s, inherited=True)
    s.set_defaults(func=cmd_score, error_label="not scored")

    d = verbs.add_parser(
        "run-due",
        help="run the spec's batch jobs whose schedule came round since their last run",
        description="For a host's own scheduler (cron, a systemd timer): every job of the "
        "spec's batch: list whose cron schedule (UTC) fired since its last recorded run runs "
        "now, one after another, and is recorded. A job never run is due. Exit 1 when one "
        "failed.",
    )
    d.add_argument("--now", help="decide (and record) at this ISO 8601 time instead of the clock's")
    d.add_argument("--progress", choices=["auto", "lines", "off"], default="off")
    add_mesh_flags(d, inherited=True)
    d.set_defaults(func=cmd_run_due, error_label="not run")

    r = verbs.add_parser("run", help="run one of the spec's batch jobs now, due or not")
    r.add_argument("job", help="the job's name in the spec's batch: list")
    r.add_argument("--now", help="record the run at this ISO 8601 time instead of the clock's")
    r.add_argument("--progress", choices=["auto", "lines", "off"], default="auto")
    add_mesh_flags(r, inherited=True)
    r.set_defaults(func=cmd_run, error_label="not run")

    h = verbs.add_parser("history", help="the batch runs recorded under the state dir")
    h.add_argument("--job", help="only the runs of this spec job")
    h.add_argument("--limit", type=int, default=20, help="the last N runs (default 20)")
    add_output(h, "print the runs as JSON")
    add_mesh_flags(h, inherited=True)
    h.set_defaults(func=cmd_history)

    plan_tiers.register(verbs)
