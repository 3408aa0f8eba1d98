"""The `trees` bench model: a gradient-boosted tree ensemble served through ONNX Runtime.

A LightGBM regressor of 200 trees (31 leaves each) fitted on seeded synthetic data, converted
by onnxmltools, with its one output renamed `score`: it takes `features` FP32 [n, 64] and
answers `score` FP32 [n, 1], as the other bench models do, so the same requests measure it.
The same seed gives the same file. Building it needs lightgbm and onnxmltools (the `test`
extras).
"""

from __future__ import annotations

import hashlib

import numpy as np

from servemesh.contract.demo import N_FEATURES, Artifact

TREES = 200
LEAVES = 31
TRAINING_ROWS = 4000
# The newest opset onnxmltools' LightGBM converter writes.
OPSET = 15


def tree_artifact(seed: int = 1) -> Artifact:
    """The ensemble for `seed`, as ONNX bytes."""
    try:
        import lightgbm
        import onnxmltools
        from onnxmltools.convert.common.data_types import FloatTensorType
    except ImportError as exc:
        raise ValueError(
            f"model: the trees bench model needs {exc.name} (pip install -e '.[test]')"
        ) from None
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(TRAINING_ROWS, N_FEATURES)).astype(np.float32)
    weights = rng.normal(size=N_FEATURES)
    # Interactions and thresholds, so that the trees split on many features at many depths.
    target = rows @ weights + np.sin(rows[:, 0] * rows[:, 1]) + (rows[:, 2] > 0.5) * 2.0
    regressor = lightgbm.LGBMRegressor(
        n_estimators=TREES, num_leaves=LEAVES, random_state=seed, n_jobs=1,
        deterministic=True, verbose=-1,
    )  # fmt: skip
    regressor.fit(rows, target)
    model = onnxmltools.convert_lightgbm(
        regressor,
        initial_types=[("features", FloatTensorType([None, N_FEATURES]))],
        target_opset=OPSET,
    )
    [output] = model.graph.output
    for node in model.graph.node:
        node.output[:] = ["score" if name == output.name else name for name in node.output]
    output.name = "score"
    model.graph.name = "trees"  # the converter's is a random id: the same seed, the same bytes
    data = bytes(model.SerializeToString())
    return Artifact(data, hashlib.sha256(data).hexdigest(), "onnx")
