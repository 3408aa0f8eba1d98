"""A zone's mirror of the registry (registry/mirror.py), against a real registry server on
loopback: it pulls every version (through the store's own sha256 check) and alias, answers
a read it missed by pulling first, serves what it holds once the registry is gone, refuses
every write naming the registry, and keeps its own bytes when the registry's differ."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import grpc
import pytest

from servemesh.contract.demo import Artifact
from servemesh.registry.app import registry_server
from servemesh.registry.client import fetch_verified, push_version, set_alias
from servemesh.registry.mirror import MirrorServicer, Puller
from servemesh.registry.store import RegistryStore
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc
from tests.control_kit import TEST_CREDENTIAL, TEST_TOKEN, credentialed_channel
from tests.registry.registry_kit import (
    INPUTS,
    MAX_ARTIFACT_BYTES,
    OUTPUTS,
    RunningRegistry,
    header_for,
)


class Mirror:
    def __init__(self, store: RegistryStore, puller: Puller, channel: grpc.aio.Channel) -> None:
        self.store = store
        self.puller = puller
        self.channel = channel  # to the mirror


@pytest.fixture
async def mirror(tmp_path: Path, registry: RunningRegistry) -> AsyncIterator[Mirror]:
    store = RegistryStore(tmp_path / "mirror", MAX_ARTIFACT_BYTES)
    to_registry = credentialed_channel(registry.address)
    puller = Puller(store, to_registry, MAX_ARTIFACT_BYTES)
    server = registry_server(
        store,
        "registry-mirror-test",
        host="127.0.0.1",
        port=0,
        control_token=TEST_TOKEN,
        make_servicer=partial(MirrorServicer, puller=puller, primary=registry.address),
    )
    port = await server.start()
    channel = credentialed_channel(f"127.0.0.1:{port}")
    try:
        yield Mirror(store, puller, channel)
    finally:
        await channel.close()
        await server.drain()
        await to_registry.close()


async def push(registry: RunningRegistry, version: str, art: Artifact) -> None:
    await push_version(
        registry.channel, model="fraud", version=version, data=art.data, inputs=INPUTS,
        outputs=OUTPUTS, credential=TEST_CREDENTIAL, labels={"source": version},
    )  # fmt: skip


async def test_a_pull_copies_every_version_and_alias_checked_by_sha256(
    registry: RunningRegistry, mirror: Mirror, demo1: Artifact, demo2: Artifact
) -> None:
    await push(registry, "v1", demo1)
    await push(registry, "v2", demo2)
    await set_alias(registry.channel, "fraud", "stable", "v1", credential=TEST_CREDENTIAL)
    report = await mirror.puller.pull_all()
    assert sorted(report.versions) == ["fraud/v1", "fraud/v2"] and not report.refused
    assert report.aliases == ["fraud@stable->v1"]
    record, data = await fetch_verified(mirror.channel, "fraud", "stable")
    assert (record.version, data) == ("v1", demo1.data)
    assert record.labels["source"] == "v1"
    # A second pull finds nothing to do.
    again = await mirror.puller.pull_all()
    assert not again.versions and not again.aliases


async def test_a_read_it_lacks_is_pulled_first_and_it_serves_alone_when_the_registry_is_gone(
    registry: RunningRegistry, mirror: Mirror, demo1: Artifact, demo2: Artifact
) -> None:
    await push(registry, "v1", demo1)
    await mirror.puller.pull_all()
    await push(registry, "v2", demo2)  # after the pull: the mirror lacks it
    record, data = await fetch_verified(mirror.channel, "fraud", "v2")
    assert (record.version, data) == ("v2", demo2.data)
    await registry.server.drain()
    # The registry is gone: what the mirror holds is still served, a miss is NOT_FOUND.
    _, data = await fetch_verified(mirror.channel, "fraud", "v1")
    assert data == demo1.data
    stub = registry_pb2_grpc.RegistryStub(mirror.channel)
    with pytest.raises(grpc.aio.AioRpcError) as missed:
        await stub.GetVersion(registry_pb2.GetVersionRequest(model="fraud", version="v9"))
    assert missed.value.code() == grpc.StatusCode.NOT_FOUND


async def test_every_write_is_refused_naming_the_registry(
    registry: RunningRegistry, mirror: Mirror, demo1: Artifact
) -> None:
    await push(registry, "v1", demo1)
    stub = registry_pb2_grpc.RegistryStub(mirror.channel)
    with pytest.raises(grpc.aio.AioRpcError) as alias:
        await set_alias(mirror.channel, "fraud", "stable", "v1", credential=TEST_CREDENTIAL)
    with pytest.raises(grpc.aio.AioRpcError) as create:
        await stub.CreateModel(registry_pb2.CreateModelRequest(name="other"))
    with pytest.raises(grpc.aio.AioRpcError) as upload:
        # No message streamed: the mirror refuses before reading any, and a client still
        # sending when the refusal arrives may see its own INTERNAL ("Failed
        # execute_batch") instead of the server's status.
        await stub.UploadVersion(iter(()), metadata=TEST_CREDENTIAL, timeout=10)
    for refused in (alias, create, upload):
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert registry.address in (refused.value.details() or "")
    # None of them wrote anything (a read on the way may have pulled what the registry has).
    models = [m.name for m in mirror.store.list_models()]
    assert models in ([], ["fraud"])
    if models:
        assert [v.version for v in mirror.store.list_versions("fraud")] in ([], ["v1"])
    assert all(not m.aliases for m in mirror.store.list_models())


async def test_a_version_held_with_other_bytes_is_kept_and_named(
    registry: RunningRegistry, mirror: Mirror, demo1: Artifact, demo2: Artifact
) -> None:
    # The mirror holds v1 with demo2's bytes (a store restored from elsewhere, say).
    mirror.store.create_model("fraud")
    with mirror.store.begin_upload(header_for(demo2.data, version="v1")) as upload:
        upload.write(demo2.data)
        upload.commit()
    await push(registry, "v1", demo1)
    report = await mirror.puller.pull_all()
    assert report.refused == ["fraud/v1"] and not report.versions
    assert mirror.store.get_version("fraud", "v1").sha256 == header_for(demo2.data).sha256
