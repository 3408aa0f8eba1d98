"""A batch run against a running mesh: its registry and Redis (and, with `through_mesh`, its
model servers), each run recorded in the history under its job's name (`servemesh batch
score`, `batch run`, `batch run-due` and the scheduler process all run through here).

What a run shows while it runs is the caller's: a progress callback, or none.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servemesh.batch.job import Progress, ScoreJob, ScoreResult
    from servemesh.spec import BatchJobSpec
    from servemesh.state.running import RunningMesh

# What a run that discarded what an interrupted run of its job left says (on stderr).
DISCARDED = "an interrupted run of this job was discarded (no --resume)"


def run_dir_for(mesh_state: Path, job: ScoreJob) -> Path:
    """A job's run folder: beside a Parquet output (same filesystem as its rename), under
    the state dir for the other outputs."""
    if job.kind == "parquet":
        out_path = Path(job.out)
        return out_path.parent / f".{out_path.name}.batch"
    digest = hashlib.sha256(job.output_key().encode()).hexdigest()[:16]
    return mesh_state / "batch" / "runs" / digest


async def score(
    mesh: RunningMesh, job: ScoreJob, progress: Progress | None, threads: int | None
) -> ScoreResult:
    """Run `job` against the mesh's registry and online store, in this process."""
    from servemesh.batch.checkpoint import RunDir
    from servemesh.batch.job import run_score
    from servemesh.contract.wire import message_size_options
    from servemesh.identity import dial_mesh, dial_registry
    from servemesh.spec.store_clients import store_writer

    spec = mesh.spec
    client = store_writer(spec, socket_connect_timeout=2.0)
    sizes = message_size_options(spec.limits.max_message_bytes)
    channel = dial_registry(spec).aio_channel(options=sizes)
    # through_mesh: the first zone's mesh listener (Envoy balances over every zone's
    # replicas of the version, the local zone's first).
    served = dial_mesh(spec, spec.zones[0]).aio_channel(options=sizes) if job.through_mesh else None
    try:
        return await run_score(
            job,
            spec=spec,
            registry=channel,
            redis=client,
            run_dir=RunDir(run_dir_for(mesh.state_dir, job)),
            progress=progress,
            num_threads=threads,
            mesh=served,
        )
    finally:
        if served is not None:
            await served.close()
        await channel.close()
        await client.aclose()


def record(mesh: RunningMesh, name: str, job: ScoreJob, result: ScoreResult | None, error: str,
           started_ms: int, finished_ms: int | None = None) -> None:  # fmt: skip
    """Record a run of `job` (under the spec job `name`, "" for a command's own) in the
    history; `finished_ms` None: now."""
    from servemesh.batch.history import RunRecord, record_run

    now = time.time_ns() // 1_000_000 if finished_ms is None else finished_ms
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


def run_recorded(
    mesh: RunningMesh,
    name: str,
    job: ScoreJob,
    *,
    threads: int | None = None,
    progress: Progress | None = None,
    now: datetime | None = None,
) -> ScoreResult:
    """Run `job` now and record it under `name` (a failed run too, then re-raised). `now`:
    the clock the run is recorded at (the real one when None)."""
    from servemesh.batch.schedule import to_ms

    started = time.perf_counter()
    started_ms = to_ms(now) if now is not None else time.time_ns() // 1_000_000

    def finished() -> int | None:
        return None if now is None else started_ms + round((time.perf_counter() - started) * 1000)

    try:
        result = asyncio.run(score(mesh, job, progress, threads))
    except Exception as exc:
        error = " ".join(str(exc).split())
        record(mesh, name, job, None, error, started_ms, finished())
        raise
    record(mesh, name, job, result, "", started_ms, finished())
    return result


def run_job(
    mesh: RunningMesh,
    job_spec: BatchJobSpec,
    now: datetime | None = None,
    progress: Progress | None = None,
) -> ScoreResult:
    """Run the spec's job `job_spec` now and record it under its name (a failed run too,
    then re-raised). `now`: the clock the run is recorded at (the real one when None)."""
    from servemesh.batch.schedule import score_job

    return run_recorded(
        mesh,
        job_spec.name,
        score_job(job_spec),
        threads=job_spec.threads,
        progress=progress,
        now=now,
    )


def summary(result: ScoreResult) -> str:
    """What a finished run says: rows, model, version, source, output, speed."""
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
    return (
        f"scored {result.rows:,} rows with {result.model} {result.version} "
        f"(sha256 {result.sha256[:12]}) from {result.source} into {result.output} "
        f"in {result.seconds:.2f} s ({result.rows_per_second:,.0f} rows/s){resumed}{left_out}"
    )
