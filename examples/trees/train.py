"""Train a scikit-learn forest and a LightGBM model on the wine data, convert both to ONNX,
and write what the mesh needs to serve them.

    python -m examples.trees.train --out trees-out

Data: scikit-learn's bundled wine dataset (178 wines, 13 measurements each, three
cultivars; no download). Both models take the 13 measurements as one input sent by the
caller and answer the most likely cultivar and the probability of each.

Writes into --out:

    forest.onnx   RandomForestClassifier, converted by skl2onnx
    gbm.onnx      LGBMClassifier, converted by onnxmltools
                  both: input measurements FP32 [-1, 13];
                        outputs label INT64 [-1], probabilities FP32 [-1, 3]
    mesh.yaml     the two models, for `servemesh apply`

Both converters are asked for plain tensors (`zipmap=False`): their default answer for a
classifier is a list of {class: probability} maps, which is not a tensor and which the
model servers refuse. Training is seeded and single-threaded: the same run gives the same
files.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.datasets import load_wine
from sklearn.ensemble import RandomForestClassifier
from sklearn.model_selection import train_test_split

SEED = 0
INPUT = "measurements"
FEATURES = 13
FOREST = "wine-forest"
GBM = "wine-gbm"
# The newest opsets both converters write: skl2onnx's for the forest; onnxmltools' LightGBM
# converter stops at 15.
FOREST_OPSETS = {"": 17, "ai.onnx.ml": 3}
GBM_OPSET = 15


@dataclass(frozen=True)
class Data:
    measurements: np.ndarray  # float32 [178, 13]
    labels: np.ndarray  # int64 [178]
    fit: np.ndarray  # row indices trained on
    held: np.ndarray  # row indices held out


@dataclass(frozen=True)
class Fitted:
    forest: RandomForestClassifier
    gbm: Any  # lightgbm.LGBMClassifier


def load() -> Data:
    measurements, labels = load_wine(return_X_y=True)
    rows = np.arange(len(labels))
    fit, held = train_test_split(rows, test_size=0.25, stratify=labels, random_state=SEED)
    # float32: what the ONNX graphs take, so the libraries see the same numbers as they do.
    return Data(
        measurements.astype(np.float32), labels.astype(np.int64), np.sort(fit), np.sort(held)
    )


def fit(data: Data) -> Fitted:
    import lightgbm

    x, y = data.measurements[data.fit], data.labels[data.fit]
    forest = RandomForestClassifier(n_estimators=50, max_depth=6, random_state=SEED, n_jobs=1)
    gbm = lightgbm.LGBMClassifier(
        n_estimators=60, num_leaves=8, min_child_samples=5, random_state=SEED, n_jobs=1,
        deterministic=True, verbose=-1,
    )  # fmt: skip
    return Fitted(forest.fit(x, y), gbm.fit(x, y))


def forest_onnx(forest: RandomForestClassifier) -> bytes:
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    model = to_onnx(
        forest,
        initial_types=[(INPUT, FloatTensorType([None, FEATURES]))],
        options={id(forest): {"zipmap": False}},
        target_opset=FOREST_OPSETS,
    )
    return bytes(model.SerializeToString())


def gbm_onnx(gbm: Any) -> bytes:
    import onnxmltools
    from onnxmltools.convert.common.data_types import FloatTensorType

    model = onnxmltools.convert_lightgbm(
        gbm,
        initial_types=[(INPUT, FloatTensorType([None, FEATURES]))],
        zipmap=False,
        target_opset=GBM_OPSET,
    )
    # The converter records the label output with a fixed first dim of 1, though the graph
    # answers one label per row: the dim is made the batch dim it is.
    label = model.graph.output[0]
    assert label.name == "label", label.name
    first = label.type.tensor_type.shape.dim[0]
    first.Clear()
    first.dim_param = "N"
    # The converter names the graph with a random id: named here, so the same run writes
    # the same bytes.
    model.graph.name = GBM
    return bytes(model.SerializeToString())


MESH_YAML = """\
# Tree models through ONNX Runtime, added to a running mesh: `servemesh apply mesh.yaml`.
models:
{models}"""
MODEL_YAML = """\
  {name}:
    inputs:
      {input}: {{raw: true}}   # the 13 measurements, sent by the caller
    versions: {{v1: {{}}}}         # pushed first: servemesh models push {file} ...
    traffic: {{v1: 100}}
"""


def write_mesh_yaml(path: Path) -> None:
    models = "".join(
        MODEL_YAML.format(name=name, input=INPUT, file=file)
        for name, file in ((FOREST, "forest.onnx"), (GBM, "gbm.onnx"))
    )
    path.write_text(MESH_YAML.format(models=models))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write into (created)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = load()
    fitted = fit(data)
    held_x, held_y = data.measurements[data.held], data.labels[data.held]
    for name, model, file, write in (
        (FOREST, fitted.forest, "forest.onnx", forest_onnx),
        (GBM, fitted.gbm, "gbm.onnx", gbm_onnx),
    ):
        correct = int((model.predict(held_x) == held_y).sum())
        onnx_bytes = write(model)
        (out / file).write_bytes(onnx_bytes)
        print(
            f"trained {name} ({type(model).__name__}): held-out accuracy "
            f"{correct / len(held_y):.4f} ({correct} of {len(held_y)})"
        )
        print(f"wrote {out / file}: sha256 {hashlib.sha256(onnx_bytes).hexdigest()}")
    write_mesh_yaml(out / "mesh.yaml")
    print(f"wrote {out / 'mesh.yaml'}: models {FOREST!r}, {GBM!r}")
    for cultivar in range(3):  # one held-out wine of each cultivar, to try a prediction
        row = next(int(r) for r in data.held if data.labels[r] == cultivar)
        values = ",".join(f"{v:g}" for v in data.measurements[row])
        print(f"held out: wine {row} (cultivar {data.labels[row]}), {INPUT}={values}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
