"""`servemesh drift` without a mesh: a reference set, shown and removed under a state dir,
the report over a recorded prediction log, and each refusal's exit status."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from servemesh.cli import main
from servemesh.predlog.buffer import predictions_dir
from servemesh.predlog.parquet_store import ParquetStore
from servemesh.predlog.references import reference_path
from servemesh.spec import MeshSpec, ModelSpec, ModelVersionSpec
from tests.predlog.records import LOGGED, row, vector


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A stopped mesh's state dir holding 400 logged calls of fraud, f00 moved by 2."""
    rng = np.random.default_rng(11)
    now = time.time()
    store = ParquetStore(predictions_dir(tmp_path / "state"), "gateway-zone-a-0")
    store.write(
        [
            row(
                now - 10 - i,
                context=LOGGED,
                inputs=vector([float(rng.normal(2, 1)), float(rng.normal(0, 1)), 1.0]),
            )
            for i in range(400)
        ]
    )
    pq.write_table(
        pa.table({"f00": rng.normal(0, 1, 2000), "f01": rng.normal(0, 1, 2000)}),
        tmp_path / "train.parquet",
    )
    spec = MeshSpec(
        models={
            "fraud": ModelSpec(
                versions={"v1": ModelVersionSpec(source="demo:1")},
                traffic={"v1": 100},
                log_features=True,
            )
        }
    )
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return tmp_path


def _drift(state: Path, *args: str) -> int:
    where = ["--state-dir", str(state / "state"), "--spec", str(state / "mesh.yaml")]
    return main(["drift", *args, *where])


def test_a_reference_set_then_the_report_names_the_moved_feature(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = str(state / "train.parquet")
    assert _drift(state, "fraud", "--set-reference", train) == 0
    said = capsys.readouterr().out
    assert "reference of fraud set from" in said and "2,000 rows, 2 features" in said
    assert reference_path(state / "state", "fraud").is_file()

    assert _drift(state, "fraud", "-o", "json") == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["calls"], report["calls_with_values"]) == (400, 400)
    verdicts = {f["feature"]: f["verdict"] for f in report["features"]}
    assert verdicts == {"f00": "drifting", "f01": "ok"} and report["drifting"] == ["f00"]

    assert _drift(state, "fraud", "--window", "1h") == 0
    table = capsys.readouterr().out
    assert "fraud, every version: 400 calls in the last 1h, 400 with feature values" in table
    assert "1 of 2 features drifting (PSI >= 0.2 with p < 0.01): f00" in table

    assert _drift(state, "fraud", "--show-reference", "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["rows"] == 2000 and set(shown["features"]) == {"f00", "f01"}
    assert len(shown["features"]["f00"]["counts"]) == 10

    assert _drift(state, "fraud", "--remove-reference") == 0
    capsys.readouterr()
    assert _drift(state, "fraud") == 1
    assert "has no drift reference" in capsys.readouterr().err
    # A file given on the command line needs nothing kept.
    assert _drift(state, "fraud", "--reference", train, "--json") == 0
    assert json.loads(capsys.readouterr().out)["drifting"] == ["f00"]


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["nope"], 1, "model 'nope' is not served"),
        (["fraud", "--version", "v9"], 1, "no version 'v9'"),
        (["fraud", "--set-reference", "missing.parquet"], 1, "not a readable Parquet file"),
        (["fraud", "--set-reference", "x.parquet", "--window", "5m"], 2, "do not go with"),
        (["fraud", "--show-reference", "--remove-reference"], 2, "give one"),
        (["fraud", "--categorical", "f00"], 2, "--categorical"),
        (["fraud", "--window", "0s"], 2, "--window"),
    ],
)
def test_refusals_say_why_with_their_exit_status(
    state: Path, args: list[str], status: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _drift(state, *args) == status
    assert says in capsys.readouterr().err


def test_a_state_dir_without_a_mesh_or_its_log_is_no_mesh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["drift", "fraud", "--state-dir", str(tmp_path)]) == 5
    assert "no running mesh" in capsys.readouterr().err
