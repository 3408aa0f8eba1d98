"""The demo "fraud score" model and features that `servemesh up` seeds the mesh with."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import numpy as np
import torch

N_FEATURES = 64
HIDDEN = 512


@dataclass(frozen=True)
class Artifact:
    data: bytes
    sha256: str

    @property
    def size(self) -> int:
        return len(self.data)


def build_fraud_model(seed: int) -> torch.nn.Module:
    """MLP 64 -> 512 -> 512 -> 1 with a sigmoid: the same weights for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, 1),
        torch.nn.Sigmoid(),
    )
    with torch.no_grad():
        for param in model.parameters():
            bound = 1.0 / np.sqrt(param.shape[-1])
            param.copy_(torch.empty(param.shape).uniform_(-bound, bound, generator=generator))
    return model.eval()


def torchscript_artifact(model: torch.nn.Module) -> Artifact:
    """Script the model and serialise it: TorchScript loads without unpickling Python code."""
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(model), buffer)
    data = buffer.getvalue()
    return Artifact(data=data, sha256=hashlib.sha256(data).hexdigest())


def demo_artifact(seed: int) -> Artifact:
    return torchscript_artifact(build_fraud_model(seed))


def demo_signature(n_features: int = N_FEATURES) -> dict[str, list[dict[str, object]]]:
    """The registry signature of the demo models: `features` FP32 [-1, n] -> `score` FP32 [-1, 1].

    Returned as keyword arguments for `servemesh.registry.client.push_version`.
    """
    return {
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, n_features]}],
        "outputs": [{"name": "score", "datatype": "FP32", "shape": [-1, 1]}],
    }


def demo_entity_id(index: int) -> str:
    return f"user-{index}"


def demo_features(n_entities: int, seed: int = 7) -> dict[str, np.ndarray]:
    """Feature rows (float32, 64 wide) for entities user-0 .. user-(n-1)."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(0.0, 1.0, size=(n_entities, N_FEATURES)).astype(np.float32)
    return {demo_entity_id(i): rows[i] for i in range(n_entities)}
