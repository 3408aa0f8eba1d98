"""`servemesh batch score|run-due|history`: batch prediction with the registry's verified
artifact over a feature view (docs/batch.md)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

from servemesh.cli.mesh import RunningMesh, add_mesh_flags, recorded_state_dir, running_mesh
from servemesh.cli.output import console, out

if TYPE_CHECKING:
    from servemesh.batch.job import ScoreJob, ScoreResult


def run_dir_for(mesh_state: Path, job: ScoreJob) -> Path:
    """A job's run folder: beside a Parquet output (same filesystem as its rename), under
    the state dir for the other outputs."""
    if job.kind == "parquet":
        out_path = Path(job.out)
        return out_path.parent / f".{out_path.name}.batch"
    digest = hashlib.sha256(job.output_key().encode()).hexdigest()[:16]
    return mesh_state / "batch" / "runs" / digest


async def score(
    mesh: RunningMesh,
    job: ScoreJob,
    progress: Callable[[int, int], None] | None,
    threads: int | None,
) -> ScoreResult:
    """Run `job` against the mesh's registry and online store, in this process."""
    import redis.asyncio as aioredis

    from servemesh.batch.checkpoint import RunDir
    from servemesh.batch.job import run_score
    from servemesh.identity import dial_registry
    from servemesh.wire import message_size_options

    spec = mesh.spec
    client = aioredis.Redis.from_url(
        spec.redis_url, password=spec.redis_password(), socket_connect_timeout=2.0
    )
    channel = dial_registry(spec).aio_channel(
        options=message_size_options(spec.limits.max_message_bytes)
    )
    try:
        return await run_score(
            job,
            spec=spec,
            registry=channel,
            redis=client,
            run_dir=RunDir(run_dir_for(mesh.state_dir, job)),
            progress=progress,
            num_threads=threads,
        )
    finally:
        await channel.close()
        await client.aclose()


def record(mesh: RunningMesh, name: str, job: ScoreJob, result: ScoreResult | None, error: str,
           started_ms: int) -> None:  # fmt: skip
    from servemesh.batch.history import RunRecord, record_run

    now = time.time_ns() // 1_000_000
    record_run(
        mesh.state_dir,
        RunRecord(
            job=name,
            model=job.model,
            version=result.version if result else (job.version or job.alias or ""),
            sha256=result.sha256 if result else "",
            rows=result.rows if result else 0,
            seconds=round(result.seconds, 3) if result else round((now - started_ms) / 1000, 3),
            output=result.output if result else job.out,
            source=result.source if result else "",
            started_at_ms=started_ms,
            finished_at_ms=now,
            status="ok" if result else "failed",
            error=error,
        ),
    )


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
        entities=Path(args.entities) if args.entities else None,
        entity_column=args.entity_column,
        table=args.table,
        chunk_rows=args.chunk_rows,
        where=args.where,
        resume=args.resume,
    )


def cmd_score(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    job = _job(args)
    args.interrupted = "the checkpoint is kept; the same command with --resume continues it"
    started_ms = time.time_ns() // 1_000_000
    try:
        with _progress(args.progress) as progress:
            result = asyncio.run(score(mesh, job, progress, args.threads))
    except Exception as exc:
        record(mesh, "", job, None, " ".join(str(exc).split()), started_ms)
        raise
    record(mesh, "", job, result, "", started_ms)
    summary(result)
    return 0


def summary(result: ScoreResult) -> None:
    if result.discarded_leftover:
        console.print("an interrupted run of this job was discarded (no --resume)")
    resumed = (
        f" (resumed at chunk {result.resumed_at_chunk + 1}/{result.chunks})"
        if result.resumed_at_chunk is not None
        else ""
    )
    left = []
    if result.missing:
        left.append(f"{result.missing:,} not in the view")
    if result.filtered:
        left.append(f"{result.filtered:,} filtered by --where")
    left_out = f"; left out: {', '.join(left)}" if left else ""
    out.print(
        f"scored {result.rows:,} rows with {result.model} {result.version} "
        f"(sha256 {result.sha256[:12]}) from {result.source} into {result.output} "
        f"in {result.seconds:.2f} s ({result.rows_per_second:,.0f} rows/s){resumed}{left_out}",
        markup=False,
    )


def cmd_history(args: argparse.Namespace) -> int:
    from servemesh.batch.history import read_history

    state_dir = recorded_state_dir(args, "batch")
    records = read_history(state_dir, args.job)[-args.limit :]
    if not records:
        out.print("no batch runs recorded", markup=False)
        return 0
    table = Table(box=None, pad_edge=False)
    for column in ("finished", "job", "model", "version", "sha256", "rows", "seconds",
                   "status", "output"):  # fmt: skip
        table.add_column(column, justify="right" if column in ("rows", "seconds") else "left")
    for r in records:
        when = datetime.fromtimestamp(r.finished_at_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
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
        description="Runs in this process with the registry's verified artifact and the "
        "online store's rows: one row per entity (its id, every output, model, version, "
        "sha256, scored_at). The output is complete or not there; Ctrl-C or a crash leaves a "
        "checkpoint that --resume continues from.",
    )
    s.add_argument("--model", required=True, help="the model (a model of the running spec)")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--version", help="the version (default: the one most traffic goes to)")
    which.add_argument("--alias", help="a registry alias naming the version")
    source = s.add_mutually_exclusive_group()
    source.add_argument("--view", help="score every entity of this view (default: the model's)")
    source.add_argument("--entities", help="score the ids in this CSV or Parquet file")
    s.add_argument("--entity-column", help="the --entities column (default: the entity's name)")
    s.add_argument(
        "--out",
        required=True,
        help="FILE.parquet, redis (the mesh's, docs/batch.md's key layout) or postgresql://...",
    )
    s.add_argument("--table", help="the PostgreSQL table (default: <model>_scores)")
    s.add_argument("--resume", action="store_true", help="continue an interrupted run")
    s.add_argument(
        "--chunk-rows", type=int, default=1024, help="rows per chunk and per batch (default 1024)"
    )
    s.add_argument("--where", help='score only rows that pass, e.g. "event_ts > 2024-05-01"')
    s.add_argument(
        "--progress",
        choices=["auto", "lines", "off"],
        default="auto",
        help="auto: a bar on a terminal; lines: a line per chunk on stderr",
    )
    s.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    add_mesh_flags(s, inherited=True)
    s.set_defaults(func=cmd_score, error_label="not scored")

    h = verbs.add_parser("history", help="the batch runs recorded under the state dir")
    h.add_argument("--job", help="only the runs of this spec job")
    h.add_argument("--limit", type=int, default=20, help="the last N runs (default 20)")
    add_mesh_flags(h, inherited=True)
    h.set_defaults(func=cmd_history)
