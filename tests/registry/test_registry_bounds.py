"""Registry uploads are bounded: a quota on stored bytes, an idle timeout, and the control
credential on every call that writes (real grpc.aio servers on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from servemesh.contract.control_credential import Metadata, control_metadata
from servemesh.contract.demo import Artifact
from servemesh.registry.app import registry_server
from servemesh.registry.client import push_version
from servemesh.registry.store import RegistryStore
from servemesh.services.runtime import ServiceServer
from servemesh_api.registry.v1 import registry_pb2 as pb
from servemesh_api.registry.v1 import registry_pb2_grpc
from tests.control_kit import TEST_CREDENTIAL, TEST_TOKEN, credentialed_channel
from tests.registry.registry_kit import MAX_ARTIFACT_BYTES, blob_files, temp_files

INPUTS = [pb.TensorSpec(name="features", datatype="FP32", shape=[-1, 64])]
OUTPUTS = [pb.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])]


def header(data: bytes, version: str = "v1") -> pb.UploadHeader:
    return pb.UploadHeader(
        model="fraud",
        version=version,
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        format="torchscript",
        inputs=INPUTS,
        outputs=OUTPUTS,
    )


async def push(channel: grpc.aio.Channel, data: bytes, version: str) -> pb.ModelVersion:
    return await push_version(
        channel,
        model="fraud",
        version=version,
        data=data,
        inputs=INPUTS,
        outputs=OUTPUTS,
        credential=TEST_CREDENTIAL,
    )


async def refused(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


Start = Callable[..., Awaitable[tuple[RegistryStore, grpc.aio.Channel, str]]]


@pytest.fixture
async def start_registry(tmp_path: Path) -> AsyncIterator[Start]:
    """`await start_registry(quota_bytes=..., idle_s=...)`: store, credentialed channel,
    address of a registry server with those bounds."""
    running: list[tuple[ServiceServer, grpc.aio.Channel]] = []

    async def start(
        quota_bytes: int | None = None, idle_s: float = 30.0
    ) -> tuple[RegistryStore, grpc.aio.Channel, str]:
        store = RegistryStore(
            tmp_path / f"registry-{len(running)}", MAX_ARTIFACT_BYTES, quota_bytes
        )
        server = registry_server(
            store, "registry-test", control_token=TEST_TOKEN, upload_idle_timeout_s=idle_s
        )
        address = f"127.0.0.1:{await server.start()}"
        channel = credentialed_channel(address)
        running.append((server, channel))
        return store, channel, address

    yield start
    for server, channel in running:
        await channel.close()
        await server.drain()


async def test_an_upload_that_would_pass_the_quota_is_refused_at_its_header(
    start_registry: Start, demo1: Artifact, demo2: Artifact
) -> None:
    store, channel, _ = await start_registry(quota_bytes=demo1.size + demo2.size // 2)
    await push(channel, demo1.data, "v1")
    # The same bytes again cost nothing more: a second name for them is within the quota.
    await push(channel, demo1.data, "v1-again")

    stub = registry_pb2_grpc.RegistryStub(channel)
    never = asyncio.Event()

    async def header_then_wait() -> AsyncIterator[pb.UploadVersionRequest]:
        yield pb.UploadVersionRequest(header=header(demo2.data, "v2"))
        await never.wait()  # only a refusal at the header ends this call

    error = await refused(stub.UploadVersion(header_then_wait(), timeout=30))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.registry_quota_bytes" in error.details()
    assert f"quota of {demo1.size + demo2.size // 2} bytes" in error.details()
    assert f"{demo1.size} bytes are used" in error.details()
    assert store.stored_bytes() == demo1.size
    assert temp_files(store.root) == []
    assert len(blob_files(store.root)) == 1


@pytest.mark.parametrize("chunks_first", [0, 1], ids=["after-the-header", "mid-artifact"])
async def test_an_upload_that_goes_quiet_is_aborted_and_leaves_nothing(
    start_registry: Start, demo1: Artifact, chunks_first: int
) -> None:
    store, channel, _ = await start_registry(idle_s=0.5)
    stub = registry_pb2_grpc.RegistryStub(channel)
    never = asyncio.Event()

    async def then_quiet() -> AsyncIterator[pb.UploadVersionRequest]:
        yield pb.UploadVersionRequest(header=header(demo1.data))
        for _ in range(chunks_first):
            yield pb.UploadVersionRequest(chunk=demo1.data[: 64 * 1024])
        await never.wait()

    # The client's deadline is far above the registry's idle timeout: the refusal is the
    # registry's own.
    error = await refused(stub.UploadVersion(then_quiet(), timeout=60))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "limits.upload_idle_timeout_s" in error.details()
    assert temp_files(store.root) == []
    assert blob_files(store.root) == []
    assert store.list_models() == []
    # The registry is none the worse: the next upload goes through.
    assert (await push(channel, demo1.data, "v1")).sha256 == demo1.sha256


async def test_an_upload_that_keeps_sending_is_not_cut_off(
    start_registry: Start, demo1: Artifact
) -> None:
    """Idle means no message for the timeout: chunks that keep coming keep an upload alive,
    however long it takes in all."""
    store, channel, _ = await start_registry(idle_s=5.0)
    stored = await push(channel, demo1.data, "v1")
    assert stored.size_bytes == demo1.size
    assert store.stored_bytes() == demo1.size


def write_calls(
    stub: registry_pb2_grpc.RegistryStub, data: bytes
) -> dict[str, Callable[[Metadata], Awaitable[object]]]:
    """Each registry control call, sent with the metadata given."""

    async def upload() -> AsyncIterator[pb.UploadVersionRequest]:
        yield pb.UploadVersionRequest(header=header(data, "v9"))
        yield pb.UploadVersionRequest(chunk=data)

    return {
        "CreateModel": lambda md: stub.CreateModel(
            pb.CreateModelRequest(name="churn"), metadata=md, timeout=30
        ),
        "UploadVersion": lambda md: stub.UploadVersion(upload(), metadata=md, timeout=30),
        "SetAlias": lambda md: stub.SetAlias(
            pb.SetAliasRequest(model="fraud", alias="production", version="v1"),
            metadata=md,
            timeout=30,
        ),
    }


def snapshot(store: RegistryStore) -> tuple[object, ...]:
    """Everything a registry write could change: models with aliases, versions, bytes."""
    models = store.list_models()
    versions = [store.list_versions(m.name) for m in models]
    return (models, versions, store.stored_bytes())


@pytest.mark.parametrize("method", ["CreateModel", "UploadVersion", "SetAlias"])
async def test_registry_writes_need_the_control_credential(
    start_registry: Start, demo1: Artifact, demo2: Artifact, method: str
) -> None:
    store, channel, address = await start_registry()
    await push(channel, demo1.data, "v1")
    before = snapshot(store)
    async with grpc.aio.insecure_channel(address) as bare:
        calls = write_calls(registry_pb2_grpc.RegistryStub(bare), demo2.data)
        error = await refused(calls[method](()))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error.details() == "control call: this method needs the mesh's control credential"
        error = await refused(calls[method](control_metadata("not-the-token")))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "not-the-token" not in (error.details() or "")
        # A bearer word of another scheme is no credential either.
        error = await refused(calls[method]((("authorization", "Basic " + TEST_TOKEN),)))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        # Nothing changed: no model, version, alias, temp file or blob was added.
        assert snapshot(store) == before
        assert temp_files(store.root) == []
        assert len(blob_files(store.root)) == 1
        # Reads need no credential.
        got = await registry_pb2_grpc.RegistryStub(bare).GetVersion(
            pb.GetVersionRequest(model="fraud", version="v1"), timeout=30
        )
        assert got.sha256 == demo1.sha256
        # With the token it works.
        await calls[method](TEST_CREDENTIAL)
    assert snapshot(store) != before
