"""Helpers shared by the model server tests (imported by name: tests/ has no packages)."""

from __future__ import annotations

import numpy as np
import torch

from servemesh.services.model.tensors import Signature, TensorSig

FEATURES = 64
SIGNATURE = Signature(
    input=TensorSig("features", "FP32", (-1, FEATURES)),
    output=TensorSig("score", "FP32", (-1, 1)),
)


def rows(n: int, seed: int = 0) -> np.ndarray:
    """n random feature rows, float32."""
    return np.random.default_rng(seed).normal(size=(n, FEATURES)).astype(np.float32)


def reference_scores(module: torch.jit.ScriptModule, batch: np.ndarray) -> np.ndarray:
    """Scores of `batch` computed one row at a time, straight through TorchScript."""
    with torch.inference_mode():
        return np.concatenate(
            [module(torch.from_numpy(row[None, :].copy())).numpy() for row in batch]
        )
