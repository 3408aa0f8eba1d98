"""Interrupted runs: Ctrl-C (a real SIGINT) or a crash (SIGKILL) to the command's process
after some chunks leaves a checkpoint and no output in place; `--resume` finishes the
job with every entity scored exactly once and none left out."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import psycopg
import pyarrow.parquet as pq

from tests.batch.conftest import BatchMesh, StartBatchMesh
from tests.postgres_server import PostgresServer

N = 2000
CHUNK = 50


async def interrupt_after(mesh: BatchMesh, chunks: int, sig: int, *args: str) -> int:
    """Start `batch score ARGS`, wait for its line saying `chunks` chunks are written, send
    `sig`; its exit status."""
    proc = await mesh.start_cli(*args, "--progress", "lines", "--chunk-rows", str(CHUNK))
    assert proc.stderr is not None
    lines: list[str] = []
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), timeout=120)).decode()
        assert line, f"the run ended before {chunks} chunks: {''.join(lines)}"
        lines.append(line)
        if line.startswith(f"scored {chunks * CHUNK:,}/"):
            break
    proc.send_signal(sig)
    await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode


def checkpoint_of(run_dir: Path) -> dict[str, object]:
    path = run_dir / "checkpoint.json"
    assert path.stat().st_mode & 0o777 == 0o600
    data: dict[str, object] = json.loads(path.read_text())
    return data


async def test_ctrl_c_leaves_a_checkpoint_and_resume_scores_the_rest_once(
    start_mesh: StartBatchMesh, tmp_path: Path
) -> None:
    # 20 ms a batch: 40 chunks take long enough to be interrupted in the middle.
    mesh = await start_mesh(inject_latency_ms=20.0)
    loaded = await mesh.load_view(N)
    out = tmp_path / "scores.parquet"
    args = ("batch", "score", "--model", "fraud", "--out", str(out))
    code = await interrupt_after(mesh, 3, signal.SIGINT, *args)
    assert code == 130
    assert not out.exists()  # never half a file
    run_dir = tmp_path / ".scores.parquet.batch"
    saved = checkpoint_of(run_dir)
    done = saved["next_chunk"]
    assert isinstance(done, int) and 3 <= done < N // CHUNK
    assert saved["rows_written"] == done * CHUNK

    code, stdout, err = await mesh.cli(*args, "--resume", "--chunk-rows", str(CHUNK))
    assert code == 0, err
    assert f"resumed at chunk {done + 1}/{N // CHUNK}" in stdout
    ids = pq.read_table(out).column("user").to_pylist()
    assert len(ids) == N and set(ids) == set(loaded["ids"])  # once each, none missing
    assert not run_dir.exists()


async def test_a_crash_mid_run_into_postgresql_resumes_without_duplicates(
    start_mesh: StartBatchMesh, postgres: PostgresServer, tmp_path: Path
) -> None:
    mesh = await start_mesh(inject_latency_ms=20.0)
    loaded = await mesh.load_view(N)
    dsn = f"postgresql://postgres@{postgres.host}:{postgres.port}/test"
    args = ("batch", "score", "--model", "fraud", "--out", dsn, "--table", "crashed")
    code = await interrupt_after(mesh, 5, signal.SIGKILL, *args)
    assert code == -signal.SIGKILL
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('crashed')").fetchone() == (None,)
        staged = conn.execute("SELECT count(*) FROM crashed__staging").fetchone()
    assert staged is not None and staged[0] >= 5 * CHUNK
    code, stdout, err = await mesh.cli(*args, "--resume", "--chunk-rows", str(CHUNK))
    assert code == 0, err
    assert "resumed at chunk" in stdout
    with psycopg.connect(dsn) as conn:
        rows = conn.execute('SELECT "user" FROM crashed').fetchall()
    assert sorted(r[0] for r in rows) == sorted(loaded["ids"])
