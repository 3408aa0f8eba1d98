"""`servemesh batch score` in-process: every entity of a view once, with the registry's
verified artifact, the same answers as the model called directly, into Parquet."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from servemesh.batch.checkpoint import RunDir
from servemesh.batch.job import ScoreJob, run_score
from servemesh.contract.demo import build_fraud_model
from tests.batch.conftest import StartBatchMesh
from tests.sandbox.spy import sandbox_spy


def reference_scores(values: np.ndarray, seed: int = 1) -> np.ndarray:
    model = build_fraud_model(seed).eval()
    with torch.no_grad():
        return model(torch.from_numpy(values)).numpy()[:, 0]


async def test_every_entity_is_scored_once_into_parquet(
    start_mesh: StartBatchMesh, tmp_path: Path
) -> None:
    mesh = await start_mesh()
    loaded = await mesh.load_view(2500)
    out = tmp_path / "scores.parquet"
    # Model batches of 96 rows within chunks of 1000 (neither divides the other): the
    # outputs of a chunk's batches are joined in row order.
    job = ScoreJob(model="fraud", out=str(out), chunk_rows=1000, batch_size=96)
    seen: list[tuple[int, int]] = []
    result = await run_score(
        job,
        spec=mesh.spec,
        registry=mesh.registry,
        redis=mesh.redis,
        run_dir=RunDir(tmp_path / "run"),
        progress=lambda done, total: seen.append((done, total)),
    )
    assert (result.rows, result.chunks, result.version) == (2500, 3, "v1")
    assert seen[-1] == (2500, 2500)
    table = pq.read_table(out)
    assert table.column_names == ["user", "score", "model", "version", "sha256", "scored_at"]
    ids = table.column("user").to_pylist()
    assert sorted(ids) == sorted(loaded["ids"]) and len(set(ids)) == 2500
    assert set(table.column("version").to_pylist()) == {"v1"}
    assert set(table.column("sha256").to_pylist()) == {result.sha256}
    index = {e: i for i, e in enumerate(loaded["ids"])}
    order = [index[e] for e in ids]
    expected = reference_scores(loaded["values"][order])
    np.testing.assert_allclose(table.column("score").to_numpy(), expected, rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "run").exists()


async def test_ids_from_a_file_and_a_where_filter(
    start_mesh: StartBatchMesh, tmp_path: Path
) -> None:
    mesh = await start_mesh()
    loaded = await mesh.load_view(100)
    ids = tmp_path / "ids.csv"
    # user-5 .. user-14, and one the view does not hold (left out, counted).
    ids.write_text("user\n" + "".join(f"user-{i}\n" for i in range(5, 15)) + "ghost\n")
    cut = int(loaded["event_ms"][9])  # rows are one second older per index
    job = ScoreJob(
        model="fraud",
        out=str(tmp_path / "some.parquet"),
        entities=ids,
        where=f"event_ts >= {cut / 1000}",
        chunk_rows=4,
    )
    result = await run_score(
        job,
        spec=mesh.spec,
        registry=mesh.registry,
        redis=mesh.redis,
        run_dir=RunDir(tmp_path / "r"),
    )
    assert (result.rows, result.missing, result.filtered) == (5, 1, 5)
    table = pq.read_table(tmp_path / "some.parquet")
    assert table.column("user").to_pylist() == [f"user-{i}" for i in range(5, 10)]


async def test_the_model_runs_in_one_sandboxed_child_of_the_run(
    start_mesh: StartBatchMesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh = await start_mesh()
    loaded = await mesh.load_view(300)
    spy = sandbox_spy(monkeypatch)  # loading a model in this process now raises
    out = tmp_path / "scores.parquet"
    job = ScoreJob(model="fraud", out=str(out), chunk_rows=100, batch_size=32)
    result = await run_score(
        job, spec=mesh.spec, registry=mesh.registry, redis=mesh.redis,
        run_dir=RunDir(tmp_path / "run"),
    )  # fmt: skip
    assert result.rows == 300
    # One child for the whole run (3 chunks of 4 batches each), confined by its filter,
    # as a user of its own when the run is root's; ended with the run.
    assert [o.entry for o in spy.opened] == [("-m", "servemesh.sandbox.child")]
    (child,) = spy.opened
    assert child.seccomp == "2"
    if os.geteuid() == 0:
        assert child.uid not in {"0", str(os.getuid())}
    assert not Path(f"/proc/{child.pid}").exists()
    table = pq.read_table(out)
    index = {e: i for i, e in enumerate(loaded["ids"])}
    order = [index[e] for e in table.column("user").to_pylist()]
    expected = reference_scores(loaded["values"][order])
    np.testing.assert_allclose(table.column("score").to_numpy(), expected, rtol=1e-5, atol=1e-6)
