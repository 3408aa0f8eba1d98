"""Drift on live traffic, on a real mesh: predictions sent through the edge with one
feature moved, a reference set with `servemesh drift --set-reference`; the prediction log
keeps each call's values (log_features) with the vector's hash and count, `servemesh drift`
names the moved feature drifting and the others not, and the registry's drift round exports
the same verdict as gauges on its /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servemesh.cli import main
from servemesh.contract.demo import DEMO_FEATURES
from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.observe.scrape import Sample, scrape
from servemesh.predlog.buffer import predictions_dir
from servemesh.predlog.query import LogQuery, ParquetReader
from servemesh.spec import (
    DemoSpec,
    DriftSpec,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    PredictionLogSpec,
    Replicas,
)
from servemesh.spec.fleet import REGISTRY_INSTANCE
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.waiting import wait_until

ZONE = "zone-a"
CALLS, ROWS = 30, 20  # 600 rows: past drift.min_rows (200)
MOVED = "f00"  # sent three standard deviations off the reference
COMPARED = ("f00", "f01", "f02")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One zone, fraud v1 keeping its calls' feature values, a drift round every second."""
    one = Replicas(per_zone={ZONE: 1})
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(tmp_path_factory.mktemp("drift")),
        zones=[ZONE],
        gateway=one,
        feature=one,
        model_servers=one,
        models={
            "fraud": ModelSpec(
                versions={"v1": ModelVersionSpec(source="demo:1")},
                traffic={"v1": 100},
                log_features=True,
            )
        },
        demo=DemoSpec(enabled=True, entities=50),
        # 64 features a row: a call of 20 rows keeps all of them.
        prediction_log=PredictionLogSpec(max_feature_bytes=65536, drift=DriftSpec(interval="1s")),
    )
    with Mesh.from_spec(spec) as running:
        yield running


def _drift(capsys: pytest.CaptureFixture[str], mesh: Mesh, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    status = main(["drift", "fraud", *args, "--state-dir", str(mesh.state_dir)])
    return status, capsys.readouterr().out


def _gauges(mesh: Mesh) -> dict[tuple[str, str], Sample]:
    samples = scrape(mesh.spec.metrics_address_of(REGISTRY_INSTANCE))
    return {
        (s.name, s.labels["feature"]): s
        for s in samples
        if s.name.startswith("servemesh_feature_drift_") and s.labels.get("model") == "fraud"
    }


def test_a_moved_feature_is_named_drifting_by_the_command_and_the_registry(
    mesh: Mesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(21)
    train = tmp_path / "train.parquet"
    pq.write_table(pa.table({f: rng.normal(0.0, 1.0, 3000) for f in COMPARED}), train)
    status, said = _drift(capsys, mesh, "--set-reference", str(train))
    assert status == 0 and "3,000 rows, 3 features (3 numeric, 0 categorical)" in said

    sent = []
    with dial_edge(mesh.spec).channel() as channel:
        gateway = gateway_pb2_grpc.GatewayStub(channel)
        for _ in range(CALLS):
            rows = rng.normal(0.0, 1.0, (ROWS, len(DEMO_FEATURES))).astype(np.float32)
            rows[:, DEMO_FEATURES.index(MOVED)] += 3.0
            request = gateway_pb2.PredictRequest(
                model="fraud", rows=[gateway_pb2.FeatureRow(values=r.tolist()) for r in rows]
            )
            reply = gateway.Predict(request, timeout=10)
            assert len(reply.scores) == ROWS
            sent.append((reply.request_id, rows))

    def reported() -> dict[str, Any] | None:
        status, printed = _drift(capsys, mesh, "-o", "json")
        report: dict[str, Any] = json.loads(printed) if status == 0 else {}
        done = report and report["calls_with_values"] >= CALLS
        return report if done else None

    report = wait_until(reported, "every call's values in the log", timeout_s=60)
    verdicts = {f["feature"]: (f["verdict"], f["rows"]) for f in report["features"]}
    assert verdicts == {
        "f00": ("drifting", CALLS * ROWS),
        "f01": ("ok", CALLS * ROWS),
        "f02": ("ok", CALLS * ROWS),
    }
    assert report["drifting"] == [MOVED]

    # The record holds the values the model got, with the vector's hash and count.
    request_id, rows = sent[0]
    reader = ParquetReader(predictions_dir(mesh.state_dir))
    (record,) = reader.query(LogQuery(request_id=request_id)).rows
    assert record["feature_count"] == ROWS * len(DEMO_FEATURES)
    assert len(record["feature_hash"]) == 32
    assert record["features"][MOVED] == pytest.approx(rows[:, 0].tolist(), rel=1e-6)
    assert list(record["features"]) == DEMO_FEATURES

    def exported() -> dict[tuple[str, str], Sample] | None:
        found = _gauges(mesh)
        rows_seen = found.get(("servemesh_feature_drift_rows", MOVED))
        return found if rows_seen is not None and rows_seen.value >= CALLS * ROWS else None

    gauges = wait_until(exported, "the registry's drift gauges over every call", timeout_s=60)
    assert gauges[("servemesh_feature_drift_psi", MOVED)].value >= 0.2
    assert gauges[("servemesh_feature_drift_p_value", MOVED)].value < 0.01
    assert gauges[("servemesh_feature_drift_psi", MOVED)].labels["version"] == "*"
    for steady in ("f01", "f02"):
        assert gauges[("servemesh_feature_drift_psi", steady)].value < 0.1

    # Without a reference the registry exports nothing for the model any more.
    status, _ = _drift(capsys, mesh, "--remove-reference")
    assert status == 0
    wait_until(lambda: not _gauges(mesh), "the drift gauges gone with the reference")
