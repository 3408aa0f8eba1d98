"""The models `servemesh bench model` and `bench predict` can measure, by key.

`demo` is the mesh's demo MLP (64 -> 512 -> 512 -> 1, TorchScript): so light that the
protocol is the whole cost. `heavy` is the same network 2048 wide, exported with
torch.export: a forward pass costs ~1 ms per batch of 16 on one core, so batching, not the
protocol, decides what a server reaches. `trees` is a LightGBM ensemble of 200 trees
served through ONNX Runtime (`trees.py`). Each takes `features` FP32 [n, 64] and answers
`score` FP32 [n, 1]: the same requests measure any of them.

A variant is a model derived as `servemesh models quantize` derives a version: `int8` is
the model's dynamic INT8 form (`servemesh.quantize`), checked against it the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from servemesh.contract.demo import (
    DEMO_SOURCE_PREFIX,
    HEAVY_SOURCE_PREFIX,
    N_FEATURES,
    Artifact,
    source_artifact,
)

VARIANTS = ("int8",)


@dataclass(frozen=True)
class BenchModel:
    key: str  # what --model names
    name: str  # the model's name on the wire and in the spec
    source_prefix: str  # the spec source that builds it: <prefix><seed>; "": `build` does
    build: Callable[[int], Artifact] | None = None  # seed -> artifact, for a model no spec
    # source builds (the bench loads it itself)

    def artifact(self, seed: int = 1, variant: str = "") -> Artifact:
        built = self.build(seed) if self.build is not None else source_artifact(self.source(seed))
        assert built is not None  # every prefix here is a built-in source
        return derived_artifact(self.name, built, variant) if variant else built

    def source(self, seed: int = 1) -> str:
        # A model the bench builds itself is, to the spec, one pushed to the registry.
        return f"{self.source_prefix}{seed}" if self.source_prefix else "registry"


def _trees(seed: int) -> Artifact:
    from servemesh.bench.model.trees import tree_artifact

    return tree_artifact(seed)


BENCH_MODELS = {
    "demo": BenchModel("demo", "fraud", DEMO_SOURCE_PREFIX),
    "heavy": BenchModel("heavy", "heavy", HEAVY_SOURCE_PREFIX),
    # A LightGBM ensemble through ONNX Runtime (trees.py).
    "trees": BenchModel("trees", "trees", "", _trees),
}


def bench_model_named(key: str) -> BenchModel:
    try:
        return BENCH_MODELS[key]
    except KeyError:
        raise ValueError(f"model: {key!r} is not one of {sorted(BENCH_MODELS)}") from None


def derived_artifact(name: str, source: Artifact, variant: str) -> Artifact:
    """`source` quantized as `models quantize --to <variant>` would push it."""
    from servemesh.quantize import Method, VersionRecord, quantize_version
    from servemesh.registry.records import TensorSpec

    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} is not one of {list(VARIANTS)}")
    record = VersionRecord(
        model=name,
        version="v1",
        sha256=source.sha256,
        format=source.format,
        inputs=[TensorSpec("features", "FP32", (-1, N_FEATURES))],
        outputs=[TensorSpec("score", "FP32", (-1, 1))],
    )
    derived = quantize_version(source.data, record, cast(Method, variant))
    return Artifact(data=derived.data, sha256=hashlib.sha256(derived.data).hexdigest())
