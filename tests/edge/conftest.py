"""Edge fixtures: a real registry server on 127.0.0.1:0 holding the demo model (TorchScript)
and the wine example's model (torch.export), and the model server's loader reading it."""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from servemesh.contract.demo import Artifact, demo_artifact
from servemesh.registry.app import registry_server
from servemesh.registry.client import push_version
from servemesh.registry.store import RegistryStore
from servemesh.services.runtime import ServiceServer
from tests.control_kit import TEST_CREDENTIAL, TEST_TOKEN, credentialed_channel

DEMO_INPUTS = [("features", "FP32", (-1, 64))]
DEMO_OUTPUTS = [("score", "FP32", (-1, 1))]
WINE_INPUTS = [("chemistry", "FP32", (-1, 10)), ("tasting", "FP32", (-1, 3))]
WINE_OUTPUTS = [("class_probs", "FP32", (-1, 3)), ("label", "INT64", (-1,))]


@dataclass(frozen=True)
class Wine:
    """The wine example trained here: its .pt2 bytes and its held-out rows."""

    data: bytes
    chemistry: np.ndarray
    tasting: np.ndarray
    labels: np.ndarray


@dataclass
class EdgeRegistry:
    store: RegistryStore
    server: ServiceServer
    address: str
    channel: grpc.aio.Channel  # carries the control credential (pushes, aliases)
    root: Path


def _demo(seed: int) -> Artifact:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        return demo_artifact(seed)


@pytest.fixture(scope="session")
def demo_models() -> dict[int, Artifact]:
    return {1: _demo(1), 2: _demo(2)}


@pytest.fixture(scope="session")
def wine(tmp_path_factory: pytest.TempPathFactory) -> Wine:
    from examples.wine import train

    data = train.load()
    trained = train.train(data)
    path = tmp_path_factory.mktemp("wine") / "wine.pt2"
    train.export(trained.model, path)
    held = trained.held_out
    return Wine(path.read_bytes(), data.chemistry[held], data.tasting[held], data.labels[held])


@pytest.fixture
async def edge_registry(
    tmp_path: Path, demo_models: dict[int, Artifact], wine: Wine
) -> AsyncIterator[EdgeRegistry]:
    """fraud v1, v2 (demo seeds 1, 2; production -> v1) and wine v1 (production -> v1)."""
    root = tmp_path / "registry"
    store = RegistryStore(root, 16 * 1024 * 1024)
    server = registry_server(
        store, "registry-edge", host="127.0.0.1", port=0, control_token=TEST_TOKEN
    )
    port = await server.start()
    address = f"127.0.0.1:{port}"
    channel = credentialed_channel(address)
    try:
        for version, seed in (("v1", 1), ("v2", 2)):
            await push_version(
                channel,
                model="fraud",
                version=version,
                data=demo_models[seed].data,
                inputs=DEMO_INPUTS,
                outputs=DEMO_OUTPUTS,
                credential=TEST_CREDENTIAL,
            )
        await push_version(
            channel,
            model="wine",
            version="v1",
            data=wine.data,
            inputs=WINE_INPUTS,
            outputs=WINE_OUTPUTS,
            credential=TEST_CREDENTIAL,
            format="torch_export",
        )
        from servemesh.registry.client import set_alias

        await set_alias(channel, "fraud", "production", "v1", credential=TEST_CREDENTIAL)
        await set_alias(channel, "wine", "production", "v1", credential=TEST_CREDENTIAL)
        yield EdgeRegistry(store, server, address, channel, root)
    finally:
        await channel.close()
        await server.drain()
