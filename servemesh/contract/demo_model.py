"""The demo "fraud score" network, as a module TorchScript names the same in any process.

Kept apart from `servemesh.contract.demo` because it needs torch at import, and the spec imports the
demo's names. The layers are plain parameters rather than `nn.Linear`: TorchScript names a
scripted `nn.Linear` class after the shapes it met earlier in the same process
(`___torch_mangle_<n>`), so the archive's bytes would depend on what else the process had
scripted. This class has one type whatever its weights, so its archive depends only on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FraudMLP(torch.nn.Module):
    """features [n, 64] -> ReLU(512) -> ReLU(512) -> sigmoid score [n, 1]."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        w1, b1, w2, b2, w3, b3 = weights
        self.w1 = torch.nn.Parameter(w1)
        self.b1 = torch.nn.Parameter(b1)
        self.w2 = torch.nn.Parameter(w2)
        self.b2 = torch.nn.Parameter(b2)
        self.w3 = torch.nn.Parameter(w3)
        self.b3 = torch.nn.Parameter(b3)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(F.linear(features, self.w1, self.b1))
        hidden = torch.relu(F.linear(hidden, self.w2, self.b2))
        return torch.sigmoid(F.linear(hidden, self.w3, self.b3))


def fraud_mlp(seed: int, n_features: int, hidden: int) -> FraudMLP:
    """The demo weights for `seed`: each tensor uniform in ±1/sqrt(its last dimension),
    drawn in layer order from one generator (the values the demo has always had)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(hidden, n_features), (hidden,), (hidden, hidden), (hidden,), (1, hidden), (1,)]
    weights = []
    for shape in shapes:
        bound = 1.0 / float(shape[-1]) ** 0.5
        weights.append(torch.empty(shape).uniform_(-bound, bound, generator=generator))
    return FraudMLP(weights).eval()
