"""Bring your own features: a file loaded into the running mesh serves predictions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from servemesh.contract.demo import DEMO_FEATURES, demo_features
from servemesh.launcher import Mesh
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc


def test_a_loaded_file_serves_predictions_through_the_mesh(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub, tmp_path: Path
) -> None:
    def scores(entities: list[str]) -> list[float]:
        request = gateway_pb2.PredictRequest(model="fraud", entity_ids=entities, version="v1")
        return list(gateway.Predict(request, timeout=5).scores)

    [before] = scores(["user-42"])
    # The demo's rows again (other tests read them), plus a new entity with user-42's values.
    rows = demo_features(mesh.spec.demo.entities)
    ids = [*rows, "byo-1"]
    matrix = np.stack([*rows.values(), rows["user-42"]])
    columns = {"id": ids, **{name: matrix[:, j] for j, name in enumerate(DEMO_FEATURES)}}
    path = tmp_path / "users.parquet"
    pq.write_table(pa.table(columns), path)
    load = subprocess.run(
        [sys.executable, "-m", "servemesh", "features", "load", str(path), "--view", "user",
         "--key", "id", "--state-dir", str(mesh.state_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert load.returncode == 0, load.stderr
    assert f"{len(ids)} rows" in load.stdout
    # Same features, same score (up to the float error of another batch shape).
    assert np.allclose(scores(["byo-1", "user-42"]), [before, before], rtol=1e-5, atol=1e-6)
