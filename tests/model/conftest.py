"""Fixtures for the model server tests: the demo model's artifacts, built once."""

from __future__ import annotations

import io

import pytest
import torch

from servemesh.demo import Artifact, demo_artifact


@pytest.fixture(scope="session")
def artifacts() -> dict[int, Artifact]:
    """The demo MLP scripted with seeds 1 and 2 (what `servemesh up` seeds as v1 and v2)."""
    return {seed: demo_artifact(seed) for seed in (1, 2)}


@pytest.fixture(scope="session")
def reference(artifacts: dict[int, Artifact]) -> dict[int, torch.jit.ScriptModule]:
    """The same artifacts loaded straight into TorchScript, to compare scores against."""
    return {seed: torch.jit.load(io.BytesIO(a.data)).eval() for seed, a in artifacts.items()}
