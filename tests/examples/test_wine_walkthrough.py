"""examples/wine, walked through as its README does: train, then the CLI alone, from
`servemesh up` to a prediction, with the bad paths a new user meets on the way; then, on
the same mesh, examples/trees (docs/models.md): tree models through ONNX Runtime.

The tests run in file order against one mesh: each step builds on the ones before it.
Steps the CLI cannot take yet (`servemesh apply`, `predict --input`) are skipped, naming
what they wait for; until `apply` exists, the view `lot` is declared at `up` instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from examples.wine.train import CHEMISTRY, TASTING, load
from servemesh.cli import build_parser
from servemesh.procs import Check, Supervisor
from servemesh.spec import DemoSpec, FeatureViewSpec, MeshSpec, Ports, Replicas

REPO = Path(__file__).resolve().parents[2]
# Lots the training held out, one per cultivar (train.py prints them).
HELD_OUT = {"L-0000": 0, "L-0060": 1, "L-0131": 2}

pytestmark = pytest.mark.timeout(300)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


_COMMANDS = _subcommands()
HAS_APPLY = "apply" in _COMMANDS
HAS_INPUTS = "--input" in _COMMANDS["predict"].format_help()
WAITS_ON_APPLY = "waits on `servemesh apply` (live models and views)"
WAITS_ON_INPUTS = "waits on `servemesh predict --entity lot=... --input ...` and named outputs"


def together(*argvs: list[str], timeout: float = 120) -> list[subprocess.CompletedProcess[str]]:
    """`python ARGV...` for each argv, all at the same time (steps that do not depend on
    each other: the CLI's start-up, mostly importing torch, is most of their time)."""
    children = [
        subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    done = []
    for argv, child in zip(argvs, children, strict=True):
        stdout, stderr = child.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(argv, child.returncode, stdout, stderr))
    return done


def servemesh(*argv: str) -> subprocess.CompletedProcess[str]:
    [done] = together(["-m", "servemesh", *argv])
    return done


@dataclass(frozen=True)
class Trained:
    out: Path
    stdout: str
    accuracy: float
    as_of: str

    @property
    def artifact(self) -> Path:
        return self.out / "wine.pt2"

    @property
    def lots(self) -> Path:
        return self.out / "lots.parquet"

    @property
    def mesh_yaml(self) -> Path:
        return self.out / "mesh.yaml"


def train_argv(out: Path, as_of: str) -> list[str]:
    return ["-m", "examples.wine.train", "--out", str(out), "--as-of", as_of]


def trained_from(done: subprocess.CompletedProcess[str], out: Path, as_of: str) -> Trained:
    assert done.returncode == 0, done.stderr
    found = re.search(r"held-out accuracy (\d\.\d{4}) \((\d+) of (\d+)\)", done.stdout)
    assert found, done.stdout
    return Trained(out, done.stdout, float(found[1]), as_of)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trained, Trained]:
    """The example trained twice, side by side, with the same event time: the lots are
    measured now (the view's max_age is 30 days), pinned so the two runs can match."""
    as_of = datetime.now(UTC).replace(microsecond=0).isoformat()
    outs = [tmp_path_factory.mktemp("wine"), tmp_path_factory.mktemp("wine-again")]
    done = together(*(train_argv(out, as_of) for out in outs))
    first, again = (trained_from(d, out, as_of) for d, out in zip(done, outs, strict=True))
    return first, again


@pytest.fixture(scope="module")
def trained(runs: tuple[Trained, Trained]) -> Trained:
    return runs[0]


@dataclass(frozen=True)
class Up:
    state: Path

    def models_argv(self, *argv: str) -> list[str]:
        """`servemesh models ...` against this mesh, as an argv for together()."""
        return ["-m", "servemesh", "models", "--state-dir", str(self.state), *argv]

    def models(self, *argv: str) -> subprocess.CompletedProcess[str]:
        [done] = together(self.models_argv(*argv))
        return done

    def listed(self) -> dict[tuple[str, str], dict[str, Any]]:
        done = self.models("list", "--json")
        assert done.returncode == 0, done.stderr
        return {(row["model"], row["version"]): row for row in json.loads(done.stdout)}

    def blobs(self) -> list[str]:
        return sorted(p.name for p in (self.state / "registry" / "blobs").rglob("*") if p.is_file())

    def resolved(self) -> dict[str, Any]:
        data: dict[str, Any] = yaml.safe_load((self.state / "mesh.resolved.yaml").read_text())
        return data


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _lot_view(trained: Trained) -> FeatureViewSpec:
    """The example's view as today's spec reads it (fields it does not know yet dropped)."""
    view = yaml.safe_load(trained.mesh_yaml.read_text())["feature_views"]["lot"]
    return FeatureViewSpec(**{k: v for k, v in view.items() if k in FeatureViewSpec.model_fields})


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, trained: Trained) -> Iterator[Up]:
    """A fresh mesh from `servemesh up` (the demo, one zone, free ports), stopped by PID."""
    root = tmp_path_factory.mktemp("mesh")
    one = Replicas(per_zone={"zone-a": 1})
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(root / "state"),
        zones=["zone-a"],
        gateway=one,
        feature=one,
        model_servers=one,
        demo=DemoSpec(enabled=True, entities=50),
    )
    if not HAS_APPLY:
        views = {**spec.feature_views, "lot": _lot_view(trained)}
        spec = spec.model_copy(update={"feature_views": views})
    spec_path = root / "mesh.yaml"
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    endpoints = root / "state" / "endpoints.json"
    with Supervisor(root / "logs") as supervisor:
        argv = [sys.executable, "-m", "servemesh", "up", "--spec", str(spec_path)]
        # endpoints.json is written once every service is SERVING and Envoy is ready.
        supervisor.start("up", argv, ready=Check(endpoints.exists, "endpoints.json"), timeout_s=180)
        yield Up(root / "state")
        pids = json.loads(endpoints.read_text())["pids"]
        assert supervisor.stop("up", grace_s=60) == 0
        assert [name for name, pid in pids.items() if _alive(pid)] == []


def test_training_is_deterministic(runs: tuple[Trained, Trained]) -> None:
    trained, again = runs
    assert 0.9 <= trained.accuracy <= 1.0
    for lot, cultivar in HELD_OUT.items():
        assert f"held out: {lot} (cultivar {cultivar})" in trained.stdout
    assert again.accuracy == trained.accuracy
    for name in ("wine.pt2", "lots.parquet", "mesh.yaml"):
        assert (trained.out / name).read_bytes() == (again.out / name).read_bytes(), name
    # The archive names no file of the machine it was trained on (stack traces dropped).
    assert b"train.py" not in trained.artifact.read_bytes()
    lots = pq.read_table(trained.lots)
    assert lots.column_names == ["lot_id", "event_ts", *CHEMISTRY]
    assert lots.num_rows == 178 and lots["lot_id"][17].as_py() == "L-0017"


def test_push_prints_the_sha256_and_show_lists_the_signature(trained: Trained, mesh: Up) -> None:
    digest = hashlib.sha256(trained.artifact.read_bytes()).hexdigest()
    pushed = mesh.models(
        "push", str(trained.artifact), "--model", "wine", "--version", "v1",
        "--metric", f"accuracy={trained.accuracy}",
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed wine v1: torch_export, " in pushed.stdout
    assert f"sha256 {digest}" in pushed.stdout
    assert "answered class_probs [2, 3], label [2]" in pushed.stdout

    # Independent steps, side by side (the alias shows up in `models list` below).
    aliased, shown = together(
        mesh.models_argv("alias", "wine", "production", "v1"),
        mesh.models_argv("show", "wine", "v1", "--json"),
    )
    assert aliased.returncode == 0, aliased.stderr
    assert "wine: production -> v1" in aliased.stdout
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert (record["version"], record["sha256"]) == ("v1", digest)
    assert record["metrics"] == {"accuracy": trained.accuracy}
    assert record["inputs"] == [
        {"name": "chemistry", "datatype": "FP32", "shape": [-1, len(CHEMISTRY)]},
        {"name": "tasting", "datatype": "FP32", "shape": [-1, len(TASTING)]},
    ]
    assert record["outputs"] == [
        {"name": "class_probs", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "label", "datatype": "INT64", "shape": [-1]},
    ]


def test_bad_models_are_refused_and_leave_nothing_behind(
    trained: Trained, mesh: Up, tmp_path: Path
) -> None:
    blobs = mesh.blobs()
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(trained.artifact.read_bytes()[: trained.artifact.stat().st_size // 2])
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(
        yaml.safe_dump(
            {
                "inputs": [
                    {"name": "chemistry", "datatype": "FP32", "shape": [-1, len(CHEMISTRY)]},
                    {"name": "tasting", "datatype": "FP32", "shape": [-1, len(TASTING)]},
                ],
                "outputs": [
                    {"name": "class_probs", "datatype": "FP32", "shape": [-1, 3]},
                    {"name": "label", "datatype": "FP32", "shape": [-1]},
                ],
            }
        )
    )
    # Two independent refusals: run side by side.
    truncated, mislabelled = together(
        mesh.models_argv("push", str(cut), "--model", "wine", "--version", "v2"),
        mesh.models_argv(
            "push", str(trained.artifact), "--model", "wine", "--version", "v2",
            "--signature", str(wrong),
        ),
    )  # fmt: skip
    assert truncated.returncode == 1
    assert "cut.pt2: truncated or damaged archive" in truncated.stderr
    assert mislabelled.returncode == 1
    assert "declared outputs[1] 'label' is FP32 [-1], the program's 'label' is INT64" in (
        mislabelled.stderr
    )
    # No version, no alias, no blob: the registry holds what it held.
    listed = mesh.listed()
    assert sorted(listed) == [("fraud", "v1"), ("fraud", "v2"), ("wine", "v1")]
    assert listed[("wine", "v1")]["aliases"] == ["production"]
    assert mesh.blobs() == blobs


@pytest.mark.skipif(not HAS_APPLY, reason=WAITS_ON_APPLY)
def test_apply_adds_the_view_and_the_model_live(trained: Trained, mesh: Up) -> None:
    applied = servemesh("apply", str(trained.mesh_yaml), "--state-dir", str(mesh.state))
    assert applied.returncode == 0, applied.stderr + applied.stdout
    resolved = mesh.resolved()
    assert "wine" in resolved["models"] and "lot" in resolved["feature_views"]
    assert "fraud" in resolved["models"]  # without --prune, the rest stays
    wine = mesh.listed()[("wine", "v1")]
    assert wine["weight"] == 100 and wine["replicas"] == ["model-wine-zone-a-0"]


def test_features_load_reports_the_rows(trained: Trained, mesh: Up) -> None:
    loaded = servemesh(
        "features", "load", str(trained.lots), "--view", "lot", "--key", "lot_id",
        "--timestamp", "event_ts", "--state-dir", str(mesh.state),
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded lots.parquet: 178 rows, 178 entities into view 'lot' as version 1" in (
        loaded.stdout
    )


def test_a_feature_file_with_text_in_a_number_column_loads_nothing(
    trained: Trained, mesh: Up, tmp_path: Path
) -> None:
    table = pq.read_table(trained.lots).to_pydict()
    table["alcohol"] = [f"{v}" for v in table["alcohol"]]
    table["alcohol"][17] = "n/a"
    bad = tmp_path / "bad_lots.parquet"
    pq.write_table(pa.table(table), bad)
    refused = servemesh(
        "features", "load", str(bad), "--view", "lot", "--key", "lot_id",
        "--timestamp", "event_ts", "--state-dir", str(mesh.state),
    )  # fmt: skip
    assert refused.returncode == 1
    assert "bad_lots.parquet: 1 problem(s); nothing was loaded" in refused.stderr
    assert "row 17: alcohol: 'n/a' is not a number" in refused.stderr
    assert "view 'lot' is as it was" in refused.stderr


def _local(trained: Trained, lots: list[str], tasting: np.ndarray) -> dict[str, np.ndarray]:
    """The trained program run here, on the rows the mesh reads for these lots."""
    table = pq.read_table(trained.lots).to_pydict()
    index = [table["lot_id"].index(lot) for lot in lots]
    chemistry = np.array([[table[f][i] for f in CHEMISTRY] for i in index], dtype=np.float32)
    program = torch.export.load(str(trained.artifact)).module()
    with torch.no_grad():
        out = program(torch.from_numpy(chemistry), torch.from_numpy(tasting))
    return {name: value.numpy() for name, value in out.items()}


@pytest.mark.skipif(not (HAS_APPLY and HAS_INPUTS), reason=f"{WAITS_ON_APPLY}; {WAITS_ON_INPUTS}")
def test_predict_answers_named_outputs_that_match_the_model_run_here(
    trained: Trained, mesh: Up
) -> None:
    lots = list(HELD_OUT)
    # Each lot's own tasting notes, from the data the example trained on.
    data = load()
    rows = [int(lot.removeprefix("L-")) for lot in lots]
    tasting = data.tasting[rows]
    argv = ["predict", "--model", "wine", "--json", "--state-dir", str(mesh.state)]
    for lot, notes in zip(lots, tasting, strict=True):
        argv += ["--entity", f"lot={lot}", "--input", "tasting=" + ",".join(map(str, notes))]
    predicted = servemesh(*argv)
    assert predicted.returncode == 0, predicted.stderr + predicted.stdout
    answer = json.loads(predicted.stdout)
    assert answer["model_version"] == "v1" and not answer["degraded"] and answer["request_id"]
    outputs = answer["outputs"]
    assert set(outputs) == {"class_probs", "label"}
    probs, labels = outputs["class_probs"], outputs["label"]
    assert (probs["datatype"], probs["shape"]) == ("FP32", [3, 3])
    assert (labels["datatype"], labels["shape"]) == ("INT64", [3])
    served_probs = np.asarray(probs["values"], dtype=np.float32).reshape(3, 3)
    served_labels = np.asarray(labels["values"], dtype=np.int64).reshape(3)

    local = _local(trained, lots, tasting)
    np.testing.assert_allclose(served_probs, local["class_probs"], rtol=1e-4, atol=1e-5)
    assert served_labels.tolist() == local["label"].tolist()
    assert served_labels.tolist() == served_probs.argmax(axis=1).tolist()
    assert served_labels.tolist() == list(HELD_OUT.values())


# Tree models through ONNX Runtime (examples/trees; docs/models.md), on the same mesh: a
# scikit-learn forest and a LightGBM model, converted, pushed, applied and called.


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trees")
    [done] = together(["-m", "examples.trees.train", "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert "held-out accuracy" in done.stdout
    return out


def test_tree_models_push_as_onnx_and_a_zipmap_output_is_refused(
    trees: Path, mesh: Up, tmp_path: Path
) -> None:
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    from examples.trees.train import FEATURES, INPUT, fit, load

    forest = fit(load()).forest
    # The converter's default for a classifier: probabilities as a list of maps.
    zipmap = tmp_path / "zipmap.onnx"
    zipmap.write_bytes(
        to_onnx(
            forest, initial_types=[(INPUT, FloatTensorType([None, FEATURES]))]
        ).SerializeToString()
    )
    blobs = mesh.blobs()
    refused, forest_push, gbm_push = together(
        mesh.models_argv("push", str(zipmap), "--model", "wine-forest", "--version", "v0"),
        mesh.models_argv("push", str(trees / "forest.onnx"), "--model", "wine-forest",
                         "--version", "v1"),
        mesh.models_argv("push", str(trees / "gbm.onnx"), "--model", "wine-gbm", "--version", "v1"),
    )  # fmt: skip
    assert refused.returncode == 1
    assert "output 'output_probability' is a sequence_type, not a tensor" in refused.stderr
    assert "options={'zipmap': False}" in refused.stderr
    for pushed in (forest_push, gbm_push):
        assert pushed.returncode == 0, pushed.stderr
        assert ": onnx, " in pushed.stdout
        assert "answered label [2], probabilities [2, 3]" in pushed.stdout
    listed = mesh.listed()
    assert ("wine-forest", "v0") not in listed
    assert {listed[(m, "v1")]["format"] for m in ("wine-forest", "wine-gbm")} == {"onnx"}
    assert len(mesh.blobs()) == len(blobs) + 2


def test_tree_models_answer_what_their_libraries_answer(trees: Path, mesh: Up) -> None:
    from examples.trees.train import INPUT, fit, load

    applied = servemesh("apply", str(trees / "mesh.yaml"), "--state-dir", str(mesh.state))
    assert applied.returncode == 0, applied.stderr + applied.stdout
    data = load()
    fitted = fit(data)
    rows = data.measurements[data.held][:5]
    argv = ["--json", "--state-dir", str(mesh.state)]
    for row in rows:
        argv += ["--input", f"{INPUT}=" + ",".join(repr(float(v)) for v in row)]
    answers = together(
        ["-m", "servemesh", "predict", "--model", "wine-forest", *argv],
        ["-m", "servemesh", "predict", "--model", "wine-gbm", *argv],
    )
    for library, done in zip((fitted.forest, fitted.gbm), answers, strict=True):
        assert done.returncode == 0, done.stderr + done.stdout
        outputs = json.loads(done.stdout)["outputs"]
        probs = outputs["probabilities"]
        assert (probs["datatype"], probs["shape"]) == ("FP32", [5, 3])
        served = np.asarray(probs["values"], dtype=np.float32).reshape(5, 3)
        np.testing.assert_allclose(served, library.predict_proba(rows), rtol=1e-4, atol=1e-5)
        assert outputs["label"]["values"] == library.predict(rows).tolist()
