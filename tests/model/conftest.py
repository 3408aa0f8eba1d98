"""Fixtures for the model server tests: the demo model's artifacts, built once, and the
bench's echo server."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator

import pytest
import torch

from servemesh.bench.model.targets import EchoServicer
from servemesh.contract.demo import Artifact, demo_artifact
from servemesh.services.model.app import SERVICE_NAME
from servemesh.services.runtime import ServiceServer
from servemesh_api.inference import grpc_service_pb2_grpc


@pytest.fixture(scope="session")
def artifacts() -> dict[int, Artifact]:
    """The demo MLP scripted with seeds 1 and 2 (what `servemesh up` seeds as v1 and v2)."""
    return {seed: demo_artifact(seed) for seed in (1, 2)}


@pytest.fixture(scope="session")
def reference(artifacts: dict[int, Artifact]) -> dict[int, torch.jit.ScriptModule]:
    """The same artifacts loaded straight into TorchScript, to compare scores against."""
    return {seed: torch.jit.load(io.BytesIO(a.data)).eval() for seed, a in artifacts.items()}


@pytest.fixture
async def echo_address() -> AsyncIterator[str]:
    """The bench's echo target (ModelInfer answered without a model), on this test's loop."""
    server = ServiceServer("echo", port=0, drain_grace_s=0.5)
    server.add_service(
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
        EchoServicer("echo", "zone-a"),
        SERVICE_NAME,
    )
    port = await server.start()
    yield f"127.0.0.1:{port}"
    await server.drain()
