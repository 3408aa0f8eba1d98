"""`--engine dask`: the chunks of a batch run scored on a Dask distributed cluster.

The command stays the driver: it loads and verifies the artifact, pins the view versions,
lists the ids and chunks them exactly as an in-process run does, and it alone writes the
output and the checkpoint, chunk by chunk in order, so `--resume` and the output that is
complete or not there work as they do in-process. Each chunk is one Dask task:

- the worker loads the model once (cached in the worker process by sha256) from the
  artifact bytes the driver verified and scattered to the workers: the sha256 checked
  again, then loaded in a sandboxed child of the worker (`servemesh.sandbox`: its own
  process and user, a syscall filter) through the model servers' guard, where it runs; the
  worker sends rows and gets arrays back, and nothing is unpickled from the artifact;
- it reads its chunk's rows from the online store with the same MGET (pointer key last)
  and selects them with the same code (`chunk.select_chunk`);
- it scores them in batches of `--batch-size` rows and returns the ids and outputs to the
  driver. The driver runs no model code at all.

At most a few chunks per worker thread are in flight; the driver takes their answers in
chunk order. The Redis password never enters a task: a task names a file holding it
(`feature_store.password_file`, or a private copy in the run's folder when the store's URL
carried the password), which each worker reads; remote workers need that file at the same
path.

`--scheduler tcp://HOST:PORT` uses a running cluster; without it the run starts a
`LocalCluster` (worker processes, one thread each, on 127.0.0.1, no dashboard) and closes
it, its worker processes ended, when the run ends however it ends.
"""

from __future__ import annotations

import logging
import signal
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from servemesh.batch.checkpoint import RunDir
from servemesh.batch.chunk import ChunkPlan, ScoredChunk, ScoredChunks, select_chunk
from servemesh.batch.errors import BatchError
from servemesh.batch.scorer import Scorer, ViewInput
from servemesh.batch.source import read_rows_sync
from servemesh.services.model.tensors import Signature
from servemesh.spec import MeshSpec, ResolvedSpec
from servemesh.spec.store_clients import store_sentinels, writer_at_sync

if TYPE_CHECKING:
    from distributed import Client
    from redis import Redis

DEFAULT_WORKERS = 2
CONNECT_TIMEOUT_S = 10
# Chunks in flight per worker thread: one scoring, one queued behind it.
IN_FLIGHT_PER_THREAD = 2
PASSWORD_FILE = "redis.password"
_MODELS_KEPT = 4  # models a long-lived worker keeps loaded (the least recent goes)


@dataclass(frozen=True)
class RedisAccess:
    """How a worker reaches the online store: the URL without a password, and the file
    that holds it (None: no password)."""

    url: str
    password_file: str | None
    # A replicated store's Sentinels: a worker writes to the primary they name (empty: the
    # single store at `url`).
    sentinels: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class WorkerModel:
    """What a worker loads the model from, besides the artifact's bytes."""

    model: str
    version: str
    sha256: str
    format: str
    signature: Signature
    inputs: tuple[ViewInput, ...]
    inject_latency_ms: float
    num_threads: int | None
    batch_size: int  # rows per call of the sandboxed model


def worker_model(scorer: Scorer, batch_size: int) -> WorkerModel:
    assert scorer.artifact is not None, "load_scorer(keep_artifact=True) for a dask run"
    threads = scorer.num_threads
    return WorkerModel(
        model=scorer.model,
        version=scorer.version,
        sha256=scorer.sha256,
        format=scorer.artifact.format,
        signature=scorer.signature,
        inputs=tuple(scorer.inputs),
        inject_latency_ms=scorer.inject_latency_ms,
        # One intra-op thread per Dask thread unless --threads says otherwise: the cluster's
        # parallelism is its worker threads.
        num_threads=threads if threads is not None else 1,
        batch_size=batch_size,
    )


def redis_access(spec: MeshSpec, run_dir: RunDir) -> RedisAccess:
    """The store's URL with any password taken out; the password stays in a file."""
    url = spec.feature_store.redis_url
    assert url, "a resolved spec names its store"
    parts = urlsplit(url)
    password_file = spec.feature_store.password_file
    if password_file is not None:
        password_file = str(Path(password_file).resolve())
    if parts.password is not None:
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{parts.username}@{host}" if parts.username else host
        if parts.port is not None:
            netloc += f":{parts.port}"
        url = urlunsplit(parts._replace(netloc=netloc))
        if password_file is None:
            # Written once, 0600 in the run's 0700 folder, removed with it.
            from servemesh.contract.atomic import atomic_write_bytes

            path = run_dir.path / PASSWORD_FILE
            atomic_write_bytes(path, parts.password.encode(), mode=0o600)
            password_file = str(path.resolve())
    sentinels = tuple(store_sentinels(spec)) if isinstance(spec, ResolvedSpec) else ()
    return RedisAccess(url, password_file, sentinels)


# --- the driver --------------------------------------------------------------------------


@asynccontextmanager
async def cluster(scheduler: str | None, workers: int | None) -> AsyncIterator[Client]:
    """A client of the cluster at `scheduler`, or of a local cluster of `workers` worker
    processes started here and closed (its processes ended) when the block ends."""
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise BatchError(
            "--engine dask: Dask distributed is not installed: pip install 'servemesh[batch-dask]'"
        ) from None
    if scheduler:
        try:
            client = await Client(scheduler, asynchronous=True, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BatchError(f"--scheduler {scheduler}: cannot connect: {first}") from None
        try:
            yield client
        finally:
            await client.close()
        return
    async with LocalCluster(
        n_workers=workers or DEFAULT_WORKERS,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        # dask_setup below, in each worker process.
        preload=[__name__],
        # Chunks still running when a run stops are cancelled: no warning for each.
        silence_logs=logging.ERROR,
        asynchronous=True,
    ) as local:
        async with Client(local, asynchronous=True) as client:
            yield client


def scored_chunks(
    client: Client,
    ids: Sequence[str],
    size: int,
    plan: ChunkPlan,
    model: WorkerModel,
    artifact_data: bytes,
    redis: RedisAccess,
) -> ScoredChunks:
    """Chunks scored by the cluster's workers, answered in chunk order."""

    async def scored(start: int, chunks: int) -> AsyncGenerator[tuple[int, ScoredChunk]]:
        if start >= chunks:
            return
        # Once to every worker (a worker that joins later gets it from a peer).
        artifact = await client.scatter(artifact_data, broadcast=True, hash=False)
        nthreads: dict[str, int] = await client.nthreads()
        window = max(2, IN_FLIGHT_PER_THREAD * sum(nthreads.values()))
        run = uuid.uuid4().hex[:8]
        futures: dict[int, Any] = {}
        submitted = start
        try:
            for index in range(start, chunks):
                while submitted < chunks and submitted < index + window:
                    futures[submitted] = client.submit(
                        score_chunk,
                        list(ids[submitted * size : (submitted + 1) * size]),
                        plan,
                        model,
                        artifact,
                        redis,
                        key=f"servemesh-batch-{run}-{submitted}",
                        pure=False,
                    )
                    submitted += 1
                done: ScoredChunk = await futures.pop(index)
                yield index, done
        finally:
            pending = list(futures.values())
            futures.clear()
            if pending:
                await client.cancel(pending, force=True)
            await client.cancel([artifact], force=True)

    return scored


# --- the workers -------------------------------------------------------------------------


def dask_setup(worker: object) -> None:
    """Run by each worker process of a local cluster as it starts: Ctrl-C at a terminal
    reaches every process of the command's group, and the command alone stops: it ends its
    workers when it closes the cluster (a worker interrupted on its own only prints a
    traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


_lock = threading.Lock()
# One sandboxed child per model a worker keeps; tasks of a worker share it (its lock).
_models: dict[tuple[str, str, int | None, int], Scorer] = {}
_clients: dict[RedisAccess, Redis] = {}


def score_chunk(
    ids: list[str], plan: ChunkPlan, model: WorkerModel, artifact: bytes, redis: RedisAccess
) -> ScoredChunk:
    """One chunk on a worker: its rows read, selected and scored (a Dask task)."""
    import redis as redis_py

    scorer = _scorer(model, artifact)
    try:
        client = _client(redis)
        rows = {v: read_rows_sync(client, p, ids) for v, p in plan.pinned.items()}
    except redis_py.RedisError as exc:
        raise BatchError(f"--engine dask: a worker cannot read the online store: {exc}") from None
    selected = select_chunk(plan, ids, rows)
    outputs = scorer.score_batches(selected.matrices, model.batch_size) if selected.kept else {}
    return ScoredChunk(selected.kept, outputs, selected.missing, selected.filtered)


def _scorer(model: WorkerModel, artifact: bytes) -> Scorer:
    key = (model.sha256, model.version, model.num_threads, model.batch_size)
    with _lock:
        found = _models.get(key)
        if found is not None:
            return found
        from servemesh.batch.scorer import open_sandboxed

        sandboxed = open_sandboxed(
            artifact,
            model=model.model,
            version=model.version,
            sha256=model.sha256,
            signature=model.signature,
            batch_size=model.batch_size,
            num_threads=model.num_threads,
            inject_latency_ms=model.inject_latency_ms,
        )
        scorer = Scorer(
            model=model.model,
            version=model.version,
            sha256=model.sha256,
            signature=model.signature,
            inputs=list(model.inputs),
            sandboxed=sandboxed,
            num_threads=model.num_threads,
            inject_latency_ms=model.inject_latency_ms,
        )
        while len(_models) >= _MODELS_KEPT:
            _models.pop(next(iter(_models))).close()
        _models[key] = scorer
        return scorer


def _client(access: RedisAccess) -> Redis:

    with _lock:
        found = _clients.get(access)
        if found is None:
            password = None
            if access.password_file is not None:
                try:
                    password = Path(access.password_file).read_text().strip() or None
                except OSError:
                    raise BatchError(
                        f"--engine dask: a worker cannot read the Redis password file "
                        f"{access.password_file} (remote workers need it at the same path)"
                    ) from None
            found = writer_at_sync(
                access.url, password, access.sentinels, socket_connect_timeout=5.0
            )
            _clients[access] = found
        return found
