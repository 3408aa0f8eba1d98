"""A defective build of the demo model, for the bad-canary drill.

It scores like the demo model but raises on inputs whose first feature is above a threshold
chosen so that exactly `percent`% of the seeded demo entities trip it: a data-dependent bug,
the kind a canary exists to catch. The failure is deterministic per entity (a retry of the
same call fails again), warm-up inputs (zeros) never trip it, and the model server isolates
the failing request from the rest of its batch, so callers see INTERNAL for that call only.
"""

from __future__ import annotations

import torch

from servemesh.contract.demo import Artifact, build_fraud_model, demo_features, torchscript_artifact

FLAKY_PREFIX = "flaky:"


class _Flaky(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, threshold: float) -> None:
        super().__init__()
        self.inner = inner
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] > self.threshold).any()):
            raise RuntimeError("canary defect: feature 0 above the threshold")
        return self.inner(x)


def parse_flaky_source(source: str) -> tuple[float, int]:
    """`flaky:<percent>[:<seed>]` -> (percent, seed of the demo weights)."""
    parts = source.removeprefix(FLAKY_PREFIX).split(":")
    try:
        percent = float(parts[0])
        seed = int(parts[1]) if len(parts) > 1 else 2
    except (ValueError, IndexError):
        raise ValueError(f"source {source!r}: expected flaky:<percent>[:<seed>]") from None
    if not 0 < percent < 50:
        # Above half, the threshold falls below zero and the warm-up (zeros) would trip it.
        raise ValueError(f"source {source!r}: percent must be within (0, 50)")
    return percent, seed


def failing_threshold(percent: float, entities: int) -> float:
    """The first-feature value above which exactly `percent`% of the demo entities lie."""
    first = sorted(float(row[0]) for row in demo_features(max(entities, 1)).values())
    failing = round(len(first) * percent / 100)
    if failing <= 0:
        return float("inf")
    # Midway between the last passing and the first failing value.
    cut = len(first) - failing
    return (first[cut - 1] + first[cut]) / 2 if cut > 0 else first[0] - 1.0


def flaky_artifact(percent: float, seed: int, entities: int) -> Artifact:
    return torchscript_artifact(
        _Flaky(build_fraud_model(seed), failing_threshold(percent, entities)).eval()
    )


# --- a version whose scores drift: the distribution check's bad canary --------------------

SHIFTED_PREFIX = "shifted:"


class _Shifted(torch.nn.Module):
    """The demo model with `delta` added to every score, clamped to [0, 1]: it answers every
    call, as fast as the original, but what it answers has moved (a broken feature
    transform, a mis-scaled retrain)."""

    def __init__(self, inner: torch.nn.Module, delta: float) -> None:
        super().__init__()
        self.inner = inner
        self.delta = delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self.inner(x) + self.delta, 0.0, 1.0)


def parse_shifted_source(source: str) -> tuple[float, int]:
    """`shifted:<delta>[:<seed>]` -> (delta, seed of the demo weights)."""
    parts = source.removeprefix(SHIFTED_PREFIX).split(":")
    try:
        delta = float(parts[0])
        seed = int(parts[1]) if len(parts) > 1 else 1
    except (ValueError, IndexError):
        raise ValueError(f"source {source!r}: expected shifted:<delta>[:<seed>]") from None
    if not -1 < delta < 1 or delta == 0:
        raise ValueError(f"source {source!r}: delta must be within (-1, 1) and not 0")
    return delta, seed


def shifted_artifact(delta: float, seed: int) -> Artifact:
    return torchscript_artifact(_Shifted(build_fraud_model(seed), delta).eval())
