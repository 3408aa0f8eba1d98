"""`servemesh batch score --through-mesh` on a real mesh: the mesh's model servers score the
same rows as the model in the command's own process (within float tolerance), with the same
version and sha256 recorded; and each request goes at the model's lowest batcher
priority."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from servemesh.launcher import Mesh
from servemesh.observe.scrape import scrape, sum_by


def cli(mesh: Mesh, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "servemesh", args[0], "--state-dir", str(mesh.state_dir), *args[1:]],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def rows_answered(mesh: Mesh) -> float:
    """Rows every model server answered for fraud v1."""
    total = 0.0
    for instance in mesh.spec.instances():
        if instance.service == "model":
            samples = scrape(mesh.spec.metrics_address_of(instance.name))
            found = sum_by(samples, "servemesh_model_inferences_total", ("model", "version"))
            total += found.get(("fraud", "v1"), 0.0)
    return total


def test_through_the_mesh_scores_the_same_rows_as_in_process(mesh: Mesh, tmp_path: Path) -> None:
    here, there = tmp_path / "here.parquet", tmp_path / "there.parquet"
    score = ("batch", "score", "--model", "fraud", "--version", "v1", "--progress", "off")
    cli(mesh, *score, "--out", str(here))
    before = rows_answered(mesh)
    # Batches of 37 rows (the last of each chunk shorter) over chunks of 200.
    said = cli(mesh, *score, "--out", str(there), "--through-mesh", "--batch-size", "37",
               "--chunk-rows", "200")  # fmt: skip
    assert "scored " in said
    a, b = pq.read_table(here), pq.read_table(there)
    assert a.num_rows == b.num_rows > 0
    # The model servers answered them (no other caller runs in the meantime but warm-ups).
    assert rows_answered(mesh) - before >= b.num_rows
    assert a.column("user").to_pylist() == b.column("user").to_pylist()
    for column in ("model", "version", "sha256"):
        assert a.column(column).to_pylist() == b.column(column).to_pylist()
    np.testing.assert_allclose(
        b.column("score").to_numpy(), a.column("score").to_numpy(), rtol=1e-5, atol=1e-6
    )


def test_a_batch_request_asks_the_lowest_priority(mesh: Mesh) -> None:
    from servemesh.batch.through_mesh import MeshModel
    from servemesh.batch.yielding import YieldingGate, YieldingWindow
    from servemesh.services.model.tensors import Signature, TensorSig

    levels = mesh.spec.models["fraud"].batching.priority_levels
    signature = Signature(TensorSig("x", "FP32", (-1, 3)), TensorSig("score", "FP32", (-1, 1)))
    model = MeshModel(
        model="fraud", version="v1", signature=signature, priority=levels,
        stub=None,  # type: ignore[arg-type]
        run_id="t", gate=YieldingGate(YieldingWindow(1)),
    )  # fmt: skip
    request = model.request({"x": np.zeros((5, 3), np.float32)})
    assert levels > mesh.spec.models["fraud"].batching.default_priority_level
    assert request.parameters["priority"].int64_param == levels
    assert (request.model_name, request.model_version) == ("fraud", "v1")
    assert list(request.inputs[0].shape) == [5, 3] and len(request.raw_input_contents[0]) == 60
