"""Registry fixtures: a store on tmp_path, and a real grpc.aio server on 127.0.0.1:0."""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from servemesh.contract.demo import Artifact, demo_artifact
from servemesh.registry.app import registry_server
from servemesh.registry.store import RegistryStore
from servemesh_api.registry.v1 import registry_pb2_grpc
from tests.control_kit import TEST_TOKEN, credentialed_channel
from tests.registry.registry_kit import MAX_ARTIFACT_BYTES, RunningRegistry


def _demo(seed: int) -> Artifact:
    # torch deprecates torch.jit.script/save in favour of torch.export; the demo stays
    # TorchScript, and the warnings would fail the run under "error".
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        return demo_artifact(seed)


@pytest.fixture(scope="session")
def demo1() -> Artifact:
    return _demo(1)


@pytest.fixture(scope="session")
def demo2() -> Artifact:
    return _demo(2)


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    return tmp_path / "registry"


@pytest.fixture
def store(store_root: Path) -> Iterator[RegistryStore]:
    store = RegistryStore(store_root, MAX_ARTIFACT_BYTES)
    yield store
    store.close()


@pytest.fixture
async def registry(store: RegistryStore) -> AsyncIterator[RunningRegistry]:
    server = registry_server(
        store, "registry-test", host="127.0.0.1", port=0, control_token=TEST_TOKEN
    )
    port = await server.start()
    address = f"127.0.0.1:{port}"
    # Every call carries the control credential, as the mesh's own callers send it.
    channel = credentialed_channel(address)
    try:
        yield RunningRegistry(
            store, server, channel, registry_pb2_grpc.RegistryStub(channel), address
        )
    finally:
        await channel.close()
        await server.drain()
