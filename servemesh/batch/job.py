"""One batch run: the ids, then chunk by chunk: read the rows, score them, write them,
record the checkpoint; at the end the output goes in place in one step.

Two sizes: a chunk (`chunk_rows`) is the unit of reading, writing and checkpointing, a
batch (`batch_size`) the rows the model is called with; a chunk is scored as its batches in
one worker thread. The stages overlap: the read of the next chunk runs while the model
scores this one, and a chunk is written (its part and the checkpoint, in a worker thread)
while the next one is scored, so a chunk's fixed costs hide behind the forward passes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import redis.asyncio as aioredis

from servemesh.batch.checkpoint import Checkpoint, RunDir, same_job
from servemesh.batch.chunk import ChunkPlan, ScoredChunk, ScoredChunks, select_chunk
from servemesh.batch.errors import BatchError, NothingToResume
from servemesh.batch.scorer import Scorer, load_scorer, view_inputs
from servemesh.batch.source import (
    PinnedView,
    check_current,
    pin_view,
    read_entity_file,
    read_rows,
    view_entity_ids,
)
from servemesh.batch.where import parse_where
from servemesh.batch.writers import (
    ParquetOutput,
    PostgresOutput,
    RedisOutput,
    Writer,
    chunk_table,
    output_schema,
    table_name,
)
from servemesh.services.feature.store import RedisFeatureStore, Rows
from servemesh.spec import MeshSpec

DEFAULT_CHUNK_ROWS = 16_384
MAX_CHUNK_ROWS = 1_048_576
DEFAULT_BATCH_SIZE = 1024
MAX_BATCH_SIZE = 65_536
WRITES_BEHIND = 2
ENGINES = ("process", "dask")

# (rows of ids done, ids in all): a progress bar's update.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ScoreJob:
    """What `servemesh batch score` was asked for."""

    model: str
    out: str  # FILE.parquet, "redis" or postgresql://...
    version: str | None = None
    alias: str | None = None
    view: str | None = None
    entities: Path | None = None
    entity_column: str | None = None
    table: str | None = None
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    # Rows per call of the model (not part of the job's identity: a resumed run may differ).
    batch_size: int = DEFAULT_BATCH_SIZE
    where: str | None = None
    resume: bool = False
    # Where the chunks are scored: in this process, or on a Dask cluster (dask_engine):
    # the one at `scheduler`, else a local one of `workers` processes the run starts.
    engine: str = "process"
    scheduler: str | None = None
    workers: int | None = None
    # Scored by the running mesh's model servers at a low priority (through_mesh.py).
    through_mesh: bool = False
    # --through-mesh without giving way to online traffic (through_mesh.py, yielding.py):
    # every request the run may have in flight, however busy the mesh.
    greedy: bool = False

    @property
    def kind(self) -> str:
        if self.out == "redis":
            return "redis"
        if self.out.startswith(("postgresql://", "postgres://")):
            return "postgresql"
        return "parquet"

    def output_key(self) -> str:
        """What names this job's output (one run folder, one checkpoint per output)."""
        if self.kind == "parquet":
            return str(Path(self.out).resolve())
        if self.kind == "postgresql":
            return f"postgresql {self.table or ''} {self.model}"
        return f"redis {self.model}"


@dataclass(frozen=True)
class ScoreResult:
    model: str
    version: str
    sha256: str
    rows: int  # rows written
    ids: int  # ids the run went through
    missing: int  # ids the view does not hold (left out)
    filtered: int  # ids --where left out
    chunks: int
    seconds: float  # scoring time of this process (a resumed run: since it resumed)
    output: str
    source: str
    resumed_at_chunk: int | None  # None: a fresh run
    discarded_leftover: bool
    started_at_ms: int = field(default_factory=lambda: time.time_ns() // 1_000_000)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


def default_version(spec: MeshSpec, model: str) -> str:
    """The version most unpinned traffic goes to (the first such, in spec order)."""
    model_spec = spec.models.get(model)
    if model_spec is None:
        raise BatchError(f"--model {model}: not a model of the spec")
    traffic = model_spec.traffic or {v: 0 for v in model_spec.versions}
    return max(traffic, key=lambda v: traffic[v])


def _check(job: ScoreJob) -> None:
    if job.version and job.alias:
        raise BatchError("--version, --alias: give one, not both")
    if job.view and job.entities:
        raise BatchError("--view, --entities: give one, not both")
    if not 1 <= job.chunk_rows <= MAX_CHUNK_ROWS:
        raise BatchError(f"--chunk-rows: {job.chunk_rows} is not 1..{MAX_CHUNK_ROWS}")
    if not 1 <= job.batch_size <= MAX_BATCH_SIZE:
        raise BatchError(f"--batch-size: {job.batch_size} is not 1..{MAX_BATCH_SIZE}")
    if job.kind == "parquet" and not job.out.endswith((".parquet", ".pq")):
        raise BatchError(f"--out {job.out}: a .parquet file, redis, or a postgresql:// address")
    if job.table and job.kind != "postgresql":
        raise BatchError("--table: only for --out postgresql://...")
    if job.engine not in ENGINES:
        raise BatchError(f"--engine {job.engine}: not one of {', '.join(ENGINES)}")
    if job.engine != "dask" and (job.scheduler or job.workers is not None):
        raise BatchError("--scheduler, --workers: only with --engine dask")
    if job.scheduler and job.workers is not None:
        raise BatchError("--workers: only for the local cluster (no --scheduler)")
    if job.workers is not None and not 1 <= job.workers <= 256:
        raise BatchError(f"--workers: {job.workers} is not 1..256")
    if job.through_mesh and job.engine != "process":
        raise BatchError("--through-mesh, --engine: the mesh's model servers score, or an engine")
    if job.greedy and not job.through_mesh:
        raise BatchError("--greedy: only with --through-mesh")


async def run_score(
    job: ScoreJob,
    *,
    spec: MeshSpec,
    registry: grpc.aio.Channel,
    redis: aioredis.Redis,
    run_dir: RunDir,
    progress: Progress | None = None,
    after_chunk: Callable[[int], None] | None = None,
    num_threads: int | None = None,
    device: str | None = None,
    mesh: grpc.aio.Channel | None = None,
) -> ScoreResult:
    """Run `job` to the end; an exception (or Ctrl-C) leaves the checkpoint for --resume.
    `mesh`: a channel to a zone's mesh listener, for `job.through_mesh`."""
    _check(job)
    inputs = view_inputs(spec, job.model)
    views = list(dict.fromkeys(i.view for i in inputs))
    entities = {spec.entity_of(v) for v in views}
    if len(entities) > 1:
        raise BatchError(
            f"--model {job.model}: reads entities {sorted(entities)}; batch scoring takes one "
            "entity's ids"
        )
    (entity,) = entities
    source_view = job.view or views[0]
    if source_view not in views:
        raise BatchError(
            f"--view {source_view}: model {job.model!r} reads {', '.join(views)}; name one of them"
        )
    saved = run_dir.load()
    if job.resume and saved is None:
        raise NothingToResume(
            f"--resume: no interrupted run of model {job.model!r} into {job.out} to resume"
        )
    resuming = job.resume and saved is not None
    version = saved.job["version"] if resuming and saved else (job.version or job.alias)
    # In process, the model runs in a sandboxed child of this run (one, loaded once, sent
    # each chunk's batches); a Dask run's workers open their own, the mesh's servers serve.
    in_process = job.engine == "process" and not job.through_mesh
    scorer = await load_scorer(
        registry,
        spec,
        job.model,
        version or default_version(spec, job.model),
        num_threads=num_threads,
        device=device,
        keep_artifact=job.engine == "dask",
        batch_size=job.batch_size if in_process else None,
    )
    try:
        return await _run_loaded(job, spec, redis, run_dir, scorer, saved, resuming, progress,
                                 after_chunk, mesh)  # fmt: skip
    finally:
        await asyncio.to_thread(scorer.close)


async def _run_loaded(
    job: ScoreJob,
    spec: MeshSpec,
    redis: aioredis.Redis,
    run_dir: RunDir,
    scorer: Scorer,
    saved: Checkpoint | None,
    resuming: bool,
    progress: Progress | None,
    after_chunk: Callable[[int], None] | None,
    mesh: grpc.aio.Channel | None,
) -> ScoreResult:
    inputs = scorer.inputs
    views = list(dict.fromkeys(i.view for i in inputs))
    source_view = job.view or views[0]
    entity = spec.entity_of(source_view)
    store = RedisFeatureStore(redis, spec.feature_store.key_prefix)
    pinned_at = saved.job.get("views", {}) if resuming and saved else {}
    pinned = {v: await pin_view(store, v, pinned_at.get(v)) for v in views}
    source = pinned[source_view]
    where = parse_where(job.where, source.version.features) if job.where else None
    if job.entities is not None:
        file = read_entity_file(job.entities, job.entity_column, entity)
        ids = file.ids
        origin = f"{job.entities} ({file.sha256[:12]})"
    else:
        ids = run_dir.load_ids() if resuming else await view_entity_ids(store, source)
        origin = f"view {source_view} version {source.version.version}"
    identity: dict[str, Any] = {
        "model": job.model,
        "version": scorer.version,
        "sha256": scorer.sha256,
        "views": {v: p.version.version for v, p in pinned.items()},
        "entities": origin,
        "ids": len(ids),
        "chunk_rows": job.chunk_rows,
        "where": job.where,
        "out": job.output_key(),
    }
    schema = output_schema(entity, _output_types(scorer))
    writer = _writer(job, spec, redis, run_dir, scorer, schema, entity, origin)
    discarded = False
    try:
        if resuming and saved is not None:
            same_job(saved.job, identity)
            checkpoint = saved
            await writer.open(checkpoint, resuming=True)
        else:
            if saved is not None:
                await writer.discard(saved)
                run_dir.remove()
                discarded = True
            checkpoint = Checkpoint(job=identity, chunks=math.ceil(len(ids) / job.chunk_rows))
            run_dir.create()
            run_dir.save_ids(ids)
            await writer.open(checkpoint, resuming=False)
            run_dir.save(checkpoint)
        resumed_at = checkpoint.next_chunk if resuming else None
        plan = ChunkPlan(
            pinned=pinned,
            source_view=source_view,
            inputs=tuple(scorer.inputs),
            defaults=(
                {v: _defaults(spec, p) for v, p in pinned.items()}
                if spec.feature_store.missing_entity == "defaults"
                else None
            ),
            where=where,
        )
        async with _engine(job, spec, ids, plan, redis, scorer, run_dir, mesh) as scored:
            started = time.perf_counter()
            counts = await _chunks(
                job, checkpoint, ids, scored, scorer, schema, writer, run_dir, progress,
                after_chunk,
            )  # fmt: skip
            for view in pinned.values():
                await check_current(redis, view)
            output = await writer.commit(checkpoint)
            seconds = time.perf_counter() - started
    finally:
        await writer.close()
    run_dir.remove()
    return ScoreResult(
        model=job.model,
        version=scorer.version,
        sha256=scorer.sha256,
        rows=checkpoint.rows_written,
        ids=len(ids),
        missing=counts[0],
        filtered=counts[1],
        chunks=checkpoint.chunks,
        seconds=seconds,
        output=output,
        source=origin,
        resumed_at_chunk=resumed_at,
        discarded_leftover=discarded,
        started_at_ms=checkpoint.started_at_ms,
    )


@asynccontextmanager
async def _engine(
    job: ScoreJob,
    spec: MeshSpec,
    ids: Sequence[str],
    plan: ChunkPlan,
    redis: aioredis.Redis,
    scorer: Scorer,
    run_dir: RunDir,
    mesh: grpc.aio.Channel | None = None,
) -> AsyncIterator[ScoredChunks]:
    """The chunks scored by the job's engine; a Dask cluster the run started is closed
    (its worker processes ended) when the block ends, however it ends."""
    if job.through_mesh:
        from servemesh.batch.through_mesh import mesh_model

        if mesh is None:
            raise BatchError("--through-mesh: no channel to the mesh")
        served = mesh_model(
            spec, scorer, mesh, job.batch_size, f"batch-{run_dir.path.name}", greedy=job.greedy
        )

        async def through(matrices: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return await served.score_batches(matrices, job.batch_size)

        yield _in_process(ids, job.chunk_rows, plan, redis, through)
        return
    if job.engine != "dask":
        yield _in_process(ids, job.chunk_rows, plan, redis, _in_thread(scorer, job.batch_size))
        return
    from servemesh.batch import dask_engine

    assert scorer.artifact is not None, "kept for a dask run"
    async with dask_engine.cluster(job.scheduler, job.workers) as client:
        yield dask_engine.scored_chunks(
            client,
            ids,
            job.chunk_rows,
            plan,
            dask_engine.worker_model(scorer, job.batch_size),
            scorer.artifact.data,
            dask_engine.redis_access(spec, run_dir),
        )


def _output_types(scorer: Scorer) -> dict[str, tuple[np.dtype[Any], int]]:
    return {t.name: (t.dtype, max(1, t.row_elements)) for t in scorer.signature.outputs}


def _writer(
    job: ScoreJob,
    spec: MeshSpec,
    redis: aioredis.Redis,
    run_dir: RunDir,
    scorer: Scorer,
    schema: Any,
    entity: str,
    origin: str,
) -> Writer:
    if job.kind == "redis":
        return RedisOutput(
            redis,
            spec.feature_store.key_prefix,
            model=job.model,
            version=scorer.version,
            sha256=scorer.sha256,
            source=origin,
            output_names=scorer.output_names,
            entity=entity,
        )
    if job.kind == "postgresql":
        return PostgresOutput(job.out, table_name(job.table, job.model), schema)
    return ParquetOutput(Path(job.out), run_dir, schema)


async def _chunks(
    job: ScoreJob,
    checkpoint: Checkpoint,
    ids: Sequence[str],
    scored: ScoredChunks,
    scorer: Scorer,
    schema: Any,
    writer: Writer,
    run_dir: RunDir,
    progress: Progress | None,
    after_chunk: Callable[[int], None] | None,
) -> tuple[int, int]:
    """Write every chunk from the checkpoint on, in chunk order, as `scored` answers them;
    (ids missing, ids filtered) of this process."""
    size = job.chunk_rows
    missing = filtered = 0
    start = checkpoint.next_chunk
    if progress is not None:
        progress(min(start * size, len(ids)), len(ids))

    async def write(index: int, done: ScoredChunk, previous: asyncio.Future[None] | None) -> None:
        """Chunk `index` into the output once the chunk before it is there, then the
        checkpoint says the output holds it."""
        if previous is not None:
            await previous
        table = chunk_table(
            schema,
            done.kept,
            done.outputs,
            model=scorer.model,
            version=scorer.version,
            sha256=scorer.sha256,
            scored_at_ms=time.time_ns() // 1_000_000,
        )
        await writer.write(index, table)
        checkpoint.next_chunk = index + 1
        checkpoint.rows_written += len(done.kept)
        await asyncio.to_thread(run_dir.save, checkpoint)
        if progress is not None:
            progress(min((index + 1) * size, len(ids)), len(ids))
        if after_chunk is not None:
            after_chunk(index)

    # Chunks are written while the next ones are scored; writes stay in chunk order (a write
    # starts when the one before it has ended), so the checkpoint never skips a chunk. At
    # most WRITES_BEHIND chunks wait for their write: memory stays bounded.
    writes: list[asyncio.Future[None]] = []
    try:
        async with aclosing(scored(start, checkpoint.chunks)) as chunks:
            async for index, done in chunks:
                missing += done.missing
                filtered += done.filtered
                writes.append(
                    asyncio.ensure_future(write(index, done, writes[-1] if writes else None))
                )
                if len(writes) > WRITES_BEHIND:
                    await writes.pop(0)
        for pending in writes:
            await pending
    finally:
        for pending in writes:
            pending.cancel()
    return missing, filtered


# A chunk's selected rows -> the model's outputs for them.
ScoreRows = Callable[[dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray]]]


def _in_thread(scorer: Scorer, batch_size: int) -> ScoreRows:
    """The model in this process, a chunk's batches in one worker thread."""

    async def score(matrices: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return await asyncio.to_thread(scorer.score_batches, matrices, batch_size)

    return score


def _in_process(
    ids: Sequence[str],
    size: int,
    plan: ChunkPlan,
    redis: aioredis.Redis,
    score: ScoreRows,
) -> ScoredChunks:
    """Chunks read and selected in this process and scored by `score`: the read of the next
    chunk runs while this one is scored."""

    async def fetch(index: int) -> dict[str, Rows]:
        chunk = ids[index * size : (index + 1) * size]
        return {v: await read_rows(redis, p, chunk) for v, p in plan.pinned.items()}

    async def scored(start: int, chunks: int) -> AsyncGenerator[tuple[int, ScoredChunk]]:
        pending = asyncio.ensure_future(fetch(start)) if start < chunks else None
        try:
            for index in range(start, chunks):
                assert pending is not None
                rows = await pending
                pending = asyncio.ensure_future(fetch(index + 1)) if index + 1 < chunks else None
                selected = select_chunk(plan, ids[index * size : (index + 1) * size], rows)
                outputs: dict[str, np.ndarray] = {}
                if selected.kept:
                    outputs = await score(selected.matrices)
                done = ScoredChunk(selected.kept, outputs, selected.missing, selected.filtered)
                yield index, done
        finally:
            if pending is not None:
                pending.cancel()

    return scored


def _defaults(spec: MeshSpec, pinned: PinnedView) -> np.ndarray:
    """The view's default row: its `defaults`, else feature_store.default_value."""
    view = spec.feature_views.get(pinned.view)
    given = view.defaults if view is not None else {}
    fallback = spec.feature_store.default_value
    return np.array([given.get(f, fallback) for f in pinned.version.features], dtype=np.float32)
