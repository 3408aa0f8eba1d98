"""The command line end to end (its own process, finding the mesh in its state dir) into
each output: Parquet, the mesh's Redis (the documented key layout) and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import psycopg
import pyarrow.parquet as pq

from tests.batch.conftest import StartBatchMesh, get
from tests.batch.test_score import reference_scores
from tests.postgres_server import PostgresServer


async def test_the_command_writes_parquet_and_records_the_run(
    start_mesh: StartBatchMesh, tmp_path: Path
) -> None:
    mesh = await start_mesh()
    await mesh.load_view(300)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "scores.parquet"
    code, stdout, err = await mesh.cli(
        "batch", "score", "--model", "fraud", "--version", "v2", "--out", str(out),
        "--chunk-rows", "64",
    )  # fmt: skip
    assert code == 0, err
    assert "scored 300 rows with fraud v2" in stdout and "rows/s" in stdout
    table = pq.read_table(out)
    assert table.num_rows == 300 and set(table.column("version").to_pylist()) == {"v2"}
    assert [p.name for p in out.parent.iterdir()] == ["scores.parquet"]  # no temp, no run dir
    code, stdout, err = await mesh.cli("batch", "history")
    assert code == 0, err
    assert "fraud" in stdout and "v2" in stdout and "300" in stdout and "ok" in stdout


async def test_bad_input_names_the_flag(start_mesh: StartBatchMesh, tmp_path: Path) -> None:
    mesh = await start_mesh()
    await mesh.load_view(10)
    code, _, err = await mesh.cli(
        "batch", "score", "--model", "nope", "--out", str(tmp_path / "x.parquet")
    )
    assert code == 1 and "--model nope" in err, err
    code, _, err = await mesh.cli(
        "batch", "score", "--model", "fraud", "--out", str(tmp_path / "x.parquet"),
        "--where", "f99 > 1",
    )  # fmt: skip
    assert code == 1 and "--where" in err, err
    assert not (tmp_path / "x.parquet").exists()


async def test_redis_output_is_flipped_current_at_the_end(
    start_mesh: StartBatchMesh, tmp_path: Path
) -> None:
    mesh = await start_mesh()
    loaded = await mesh.load_view(200)
    code, stdout, err = await mesh.cli("batch", "score", "--model", "fraud", "--out", "redis")
    assert code == 0, err
    base = f"{mesh.spec.feature_store.key_prefix}.scores:fraud:v1"
    run = int(await get(mesh.redis, f"{base}:current"))
    stored = await mesh.redis.hgetall(f"{base}@{run}")
    meta = {_text(k): _text(v) for k, v in stored.items()}
    assert meta["version"] == "v1" and meta["rows"] == "200" and len(meta["sha256"]) == 64
    assert json.loads(meta["outputs"]) == ["score"] and int(meta["scored_at_ms"]) > 0
    values = await mesh.redis.mget([f"{base}@{run}:{e}" for e in loaded["ids"]])
    scores = np.array([json.loads(v or b"")["outputs"]["score"][0] for v in values], np.float32)
    np.testing.assert_allclose(scores, reference_scores(loaded["values"]), rtol=1e-5, atol=1e-6)
    # A second run replaces the first: one run's keys remain.
    code, _, err = await mesh.cli("batch", "score", "--model", "fraud", "--out", "redis")
    assert code == 0, err
    second = int(await get(mesh.redis, f"{base}:current"))
    assert second == run + 1
    assert not [k async for k in mesh.redis.scan_iter(match=f"{base}@{run}*")]
    assert len([k async for k in mesh.redis.scan_iter(match=f"{base}@{second}:*")]) == 200


async def test_postgresql_output_is_swapped_in_whole(
    start_mesh: StartBatchMesh, postgres: PostgresServer, tmp_path: Path
) -> None:
    mesh = await start_mesh()
    loaded = await mesh.load_view(500)
    dsn = f"postgresql://postgres@{postgres.host}:{postgres.port}/test"
    args = ("batch", "score", "--model", "fraud", "--out", dsn, "--table", "fraud_nightly")
    code, stdout, err = await mesh.cli(*args, "--chunk-rows", "128")
    assert code == 0, err
    assert "postgresql table fraud_nightly" in stdout
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            'SELECT "user", score, model, version, sha256, scored_at FROM fraud_nightly'
        ).fetchall()
        tables = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables").fetchall()]
    assert len(rows) == 500 and {r[0] for r in rows} == set(loaded["ids"])
    assert {r[3] for r in rows} == {"v1"} and "fraud_nightly__staging" not in tables
    index = {e: i for i, e in enumerate(loaded["ids"])}
    got = np.array([r[1] for r in sorted(rows, key=lambda r: index[r[0]])], dtype=np.float32)
    np.testing.assert_allclose(got, reference_scores(loaded["values"]), rtol=1e-5, atol=1e-6)
    # Run again: the table is replaced, not appended to.
    code, _, err = await mesh.cli(*args)
    assert code == 0, err
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM fraud_nightly").fetchone() == (500,)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
