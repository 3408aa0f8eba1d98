"""`batch score --engine dask`: the chunks scored on a Dask distributed cluster give the same
rows as an in-process run; a run interrupted on the command's own local cluster resumes
with every entity once; the local cluster's worker processes are gone when the command is."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from servemesh.batch.checkpoint import RunDir
from servemesh.batch.errors import BatchError
from servemesh.batch.job import ScoreJob, run_score
from servemesh.observe.cpu import descendants
from tests.batch.conftest import DEFAULT_SIGINT, BatchMesh, StartBatchMesh
from tests.batch.test_resume import checkpoint_of
from tests.batch.test_score import reference_scores

pytest.importorskip("distributed")

N = 2000
CHUNK = 50


def alive(pid: int) -> bool:
    """Running (a zombie has ended: it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def is_dask_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    # Dask titles its workers ("dask worker [address]") where setproctitle is installed,
    # as it is with servemesh; otherwise a worker shows multiprocessing's spawn command.
    spawned = b"multiprocessing" in cmdline and b"spawn_main" in cmdline
    return spawned or cmdline.startswith(b"dask worker")


async def watch_run(
    mesh: BatchMesh, *args: str, stop_after: int | None = None
) -> tuple[int, set[int], set[int]]:
    """Run `batch score ARGS --progress lines` in a process group of its own; with
    `stop_after`, SIGINT to the whole group (a terminal's Ctrl-C) once that many chunks are
    written. Its exit status, the processes below it seen while it ran (looked at with each
    progress line) and which of them were Dask workers."""
    proc = await asyncio.create_subprocess_exec(
        *DEFAULT_SIGINT, sys.executable, "-m", "servemesh", *args, "--progress", "lines",
        "--chunk-rows", str(CHUNK), "--state-dir", str(mesh.state_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    seen: set[int] = set()
    workers: set[int] = set()
    lines: list[str] = []
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), timeout=120)).decode()
        if not line:
            break
        lines.append(line)
        if line.startswith("scored "):
            now = set(descendants(proc.pid))
            seen |= now
            workers |= {pid for pid in now if is_dask_worker(pid)}
        if stop_after is not None and line.startswith(f"scored {stop_after * CHUNK:,}/"):
            os.killpg(proc.pid, signal.SIGINT)
            stop_after = None
    await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None, "".join(lines)
    # The workers ignore Ctrl-C (the command ends them): none is interrupted on its own.
    assert "KeyboardInterrupt" not in "".join(lines), "".join(lines)
    return proc.returncode, seen, workers


async def assert_gone(pids: set[int], workers: set[int]) -> None:
    """The worker processes ended with the command; any other process below it (Python's
    multiprocessing resource tracker, which exits when it sees its parent gone) ends too."""
    assert len(workers) >= 2, f"no worker processes seen below the command: {pids}"
    left = sorted(pid for pid in workers if alive(pid))
    assert not left, f"worker processes of the command still running: {left}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while others := sorted(pid for pid in pids - workers if alive(pid)):
        assert loop.time() < deadline, f"processes of the command still running: {others}"
        await asyncio.sleep(0.05)


def sandboxed_children() -> list[tuple[str, object]]:
    """On a worker: (the seccomp mode of each model's child, the runner the worker holds)."""
    from servemesh.batch import dask_engine

    found = []
    for scorer in dask_engine._models.values():
        assert scorer.sandboxed is not None
        status = Path(f"/proc/{scorer.sandboxed.pid}/status").read_text()
        seccomp = next(
            line.split()[1] for line in status.splitlines() if line.startswith("Seccomp:")
        )
        found.append((seccomp, getattr(scorer, "runner", None)))
    return found


async def test_a_cluster_at_an_address_scores_the_same_rows_as_in_process(
    start_mesh: StartBatchMesh, tmp_path: Path
) -> None:
    from distributed import Client, LocalCluster

    from servemesh.batch import dask_engine

    mesh = await start_mesh()
    loaded = await mesh.load_view(1500)
    local = tmp_path / "local.parquet"
    job = ScoreJob(model="fraud", out=str(local), chunk_rows=200)
    result = await run_score(
        job,
        spec=mesh.spec,
        registry=mesh.registry,
        redis=mesh.redis,
        run_dir=RunDir(tmp_path / "r"),
    )
    async with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        asynchronous=True,
    ) as cluster:
        async with Client(cluster, asynchronous=True) as client:
            out = tmp_path / "dask.parquet"
            code, stdout, err = await mesh.cli(
                "batch", "score", "--model", "fraud", "--out", str(out), "--chunk-rows", "200",
                "--engine", "dask", "--scheduler", cluster.scheduler_address,
            )  # fmt: skip
            assert code == 0, err
            # The workers loaded the artifact (once each at most), verified by its sha256.
            loaded_by = await client.run(lambda: [k[0] for k in dask_engine._models])
            # ... each in a sandboxed child of its own, confined by its filter, where the
            # model runs: a worker holds no model of its own.
            children = await client.run(sandboxed_children)
    scoring = [child for found in children.values() for child in found]
    assert scoring and all(seccomp == "2" and runner is None for seccomp, runner in scoring)
    assert any(keys == [result.sha256] for keys in loaded_by.values()), loaded_by
    assert f"(sha256 {result.sha256[:12]})" in stdout and "scored 1,500 rows" in stdout
    ours, theirs = pq.read_table(local), pq.read_table(out)
    assert theirs.column_names == ours.column_names
    assert theirs.column("user").to_pylist() == ours.column("user").to_pylist()  # chunk order
    for column in ("model", "version", "sha256"):
        assert theirs.column(column).to_pylist() == ours.column(column).to_pylist()
    assert set(theirs.column("version").to_pylist()) == {"v1"}
    scores = theirs.column("score").to_numpy()
    np.testing.assert_allclose(scores, ours.column("score").to_numpy(), rtol=1e-5, atol=1e-6)
    index = {e: i for i, e in enumerate(loaded["ids"])}
    order = [index[e] for e in theirs.column("user").to_pylist()]
    expected = reference_scores(loaded["values"][order])
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)


async def test_interrupted_on_a_local_cluster_resumes_once_and_leaves_no_worker(
    start_mesh: StartBatchMesh, tmp_path: Path
) -> None:
    # 100 ms a batch: 40 chunks on 2 workers take ~2 s, interrupted well before the end.
    mesh = await start_mesh(inject_latency_ms=100.0)
    loaded = await mesh.load_view(N)
    out = tmp_path / "scores.parquet"
    args = ("batch", "score", "--model", "fraud", "--out", str(out), "--engine", "dask")
    code, seen, workers = await watch_run(mesh, *args, stop_after=3)
    assert code == 130
    await assert_gone(seen, workers)
    assert not out.exists()  # never half a file
    run_dir = tmp_path / ".scores.parquet.batch"
    saved = checkpoint_of(run_dir)
    done = saved["next_chunk"]
    assert isinstance(done, int) and 3 <= done < N // CHUNK
    assert saved["rows_written"] == done * CHUNK

    code, seen, workers = await watch_run(mesh, *args, "--resume")
    assert code == 0
    await assert_gone(seen, workers)
    ids = pq.read_table(out).column("user").to_pylist()
    assert len(ids) == N and set(ids) == set(loaded["ids"])  # once each, none missing
    assert not run_dir.exists()


async def test_engine_flags_are_checked(start_mesh: StartBatchMesh, tmp_path: Path) -> None:
    mesh = await start_mesh()
    await mesh.load_view(10)
    for job, message in [
        (ScoreJob(model="fraud", out="x.parquet", scheduler="tcp://127.0.0.1:1"), "--scheduler"),
        (ScoreJob(model="fraud", out="x.parquet", engine="ray"), "--engine ray"),
        (
            ScoreJob(
                model="fraud", out="x.parquet", engine="dask", scheduler="tcp://a:1", workers=2
            ),
            "--workers",
        ),
    ]:
        with pytest.raises(BatchError, match=message):
            await run_score(
                job, spec=mesh.spec, registry=mesh.registry, redis=mesh.redis,
                run_dir=RunDir(tmp_path / "r"),
            )  # fmt: skip
    assert not (tmp_path / "r").exists()
