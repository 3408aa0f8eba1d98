"""The Registry gRPC service against a real grpc.aio server on 127.0.0.1, and its client."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import pytest

from servemesh.contract.demo import Artifact
from servemesh.registry.client import (
    ArtifactIntegrityError,
    ArtifactTooLargeError,
    fetch_verified,
    push_version,
    set_alias,
)
from servemesh_api.registry.v1 import registry_pb2 as pb
from tests.control_kit import TEST_CREDENTIAL
from tests.registry.registry_kit import (
    MAX_ARTIFACT_BYTES,
    RunningRegistry,
    blob_files,
    blob_path,
    corrupt,
    temp_files,
)
from tests.waiting import wait_until_async

INPUTS = [pb.TensorSpec(name="features", datatype="FP32", shape=[-1, 64])]
OUTPUTS = [pb.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])]
CHUNK = 256 * 1024


def header(
    data: bytes, model: str = "fraud", version: str = "v1", **changes: object
) -> pb.UploadHeader:
    fields: dict[str, Any] = {
        "model": model,
        "version": version,
        "sha256": hashlib.sha256(data).hexdigest(),
        "size_bytes": len(data),
        "format": "torchscript",
        "inputs": INPUTS,
        "outputs": OUTPUTS,
        **changes,
    }
    return pb.UploadHeader(**fields)


def requests(head: pb.UploadHeader | None, data: bytes) -> list[pb.UploadVersionRequest]:
    messages = [pb.UploadVersionRequest(header=head)] if head is not None else []
    for start in range(0, len(data), CHUNK):
        messages.append(pb.UploadVersionRequest(chunk=data[start : start + CHUNK]))
    return messages


async def stream(
    messages: Sequence[pb.UploadVersionRequest], hold_open: asyncio.Event | None = None
) -> AsyncIterator[pb.UploadVersionRequest]:
    """Yield the messages; with `hold_open`, then keep the stream open until it is set."""
    for message in messages:
        yield message
    if hold_open is not None:
        await hold_open.wait()


async def refused(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def push(registry: RunningRegistry, data: bytes, version: str = "v1") -> pb.ModelVersion:
    return await push_version(
        registry.channel,
        model="fraud",
        version=version,
        data=data,
        inputs=INPUTS,
        outputs=OUTPUTS,
        credential=TEST_CREDENTIAL,
    )


async def assert_nothing_left(registry: RunningRegistry) -> None:
    root = registry.store.root
    assert temp_files(root) == []
    assert blob_files(root) == []
    error = await refused(
        registry.stub.GetVersion(pb.GetVersionRequest(model="fraud", version="v1"))
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert (await registry.stub.ListModels(pb.ListModelsRequest())).models == []


async def test_round_trip_of_the_demo_artifact_is_byte_identical(
    registry: RunningRegistry, demo1: Artifact
) -> None:
    pushed = await push_version(
        registry.channel,
        model="fraud",
        version="v1",
        data=demo1.data,
        inputs=INPUTS,
        outputs=OUTPUTS,
        credential=TEST_CREDENTIAL,
        labels={"source": "demo:1"},
    )
    assert (pushed.sha256, pushed.size_bytes, pushed.format) == (
        demo1.sha256,
        demo1.size,
        "torchscript",
    )

    record, data = await fetch_verified(registry.channel, "fraud", "v1")
    assert data == demo1.data
    assert record == pushed
    assert dict(record.labels) == {"source": "demo:1"}
    assert list(record.inputs) == INPUTS and list(record.outputs) == OUTPUTS

    chunks = [
        c
        async for c in registry.stub.DownloadArtifact(
            pb.DownloadArtifactRequest(model="fraud", version="v1")
        )
    ]
    assert len(chunks) == -(-demo1.size // CHUNK)
    assert chunks[0].version == pushed
    assert not any(c.HasField("version") for c in chunks[1:])
    assert hashlib.sha256(b"".join(c.data for c in chunks)).hexdigest() == demo1.sha256


async def test_bytes_not_matching_the_declared_sha256_are_refused_and_leave_nothing(
    registry: RunningRegistry, demo1: Artifact
) -> None:
    wrong = hashlib.sha256(b"something else").hexdigest()
    error = await refused(
        registry.stub.UploadVersion(stream(requests(header(demo1.data, sha256=wrong), demo1.data)))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "chunk data does not match header.sha256"
    await assert_nothing_left(registry)


@pytest.mark.parametrize("declared_delta", [+1, -1])
async def test_bytes_not_matching_the_declared_size_are_refused_and_leave_nothing(
    registry: RunningRegistry, demo1: Artifact, declared_delta: int
) -> None:
    head = header(demo1.data, size_bytes=demo1.size + declared_delta)
    error = await refused(registry.stub.UploadVersion(stream(requests(head, demo1.data))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header.size_bytes" in error.details()
    await assert_nothing_left(registry)


async def test_a_declared_size_over_the_limit_is_refused_before_the_bytes_arrive(
    registry: RunningRegistry,
) -> None:
    head = header(b"x", size_bytes=MAX_ARTIFACT_BYTES + 1)
    never = asyncio.Event()
    # The stream stays open after the header: only an early refusal ends the call.
    error = await refused(
        registry.stub.UploadVersion(stream(requests(head, b""), never), timeout=5)
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details().startswith("header.size_bytes:")
    await assert_nothing_left(registry)


async def test_bytes_crossing_the_limit_are_refused_mid_stream(registry: RunningRegistry) -> None:
    data = b"\x01" * (MAX_ARTIFACT_BYTES + CHUNK)
    head = header(data, size_bytes=MAX_ARTIFACT_BYTES)
    never = asyncio.Event()
    error = await refused(
        registry.stub.UploadVersion(stream(requests(head, data), never), timeout=5)
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{MAX_ARTIFACT_BYTES} bytes" in error.details()
    await assert_nothing_left(registry)


async def test_an_alias_is_resolved_by_get_version_and_download(
    registry: RunningRegistry, demo1: Artifact, demo2: Artifact
) -> None:
    await push(registry, demo1.data, "v1")
    v2 = await push(registry, demo2.data, "v2")

    model = await set_alias(
        registry.channel, "fraud", "production", "v2", credential=TEST_CREDENTIAL
    )
    assert dict(model.aliases) == {"production": "v2"}

    got = await registry.stub.GetVersion(pb.GetVersionRequest(model="fraud", version="production"))
    assert got == v2
    record, data = await fetch_verified(registry.channel, "fraud", "production")
    assert record.version == "v2" and data == demo2.data
    listed = await registry.stub.ListModels(pb.ListModelsRequest())
    assert [(m.name, dict(m.aliases)) for m in listed.models] == [("fraud", {"production": "v2"})]


async def test_unknown_models_versions_and_aliases_are_not_found_by_name(
    registry: RunningRegistry, demo1: Artifact
) -> None:
    stub = registry.stub
    error = await refused(stub.GetVersion(pb.GetVersionRequest(model="ghost", version="v1")))
    assert (error.code(), error.details()) == (grpc.StatusCode.NOT_FOUND, "model 'ghost' not found")
    error = await refused(stub.ListVersions(pb.ListVersionsRequest(model="ghost")))
    assert (error.code(), error.details()) == (grpc.StatusCode.NOT_FOUND, "model 'ghost' not found")

    await push(registry, demo1.data)
    for call in (
        stub.GetVersion(pb.GetVersionRequest(model="fraud", version="v7")),
        stub.SetAlias(pb.SetAliasRequest(model="fraud", alias="production", version="v7")),
        stub.DownloadArtifact(pb.DownloadArtifactRequest(model="fraud", version="v7")).read(),
    ):
        error = await refused(call)
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "'v7' of model 'fraud'" in error.details()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda s: s.CreateModel(pb.CreateModelRequest(name="Fraud")), "name"),
        (lambda s: s.ListVersions(pb.ListVersionsRequest(model="")), "model"),
        (lambda s: s.GetVersion(pb.GetVersionRequest(model="fraud", version="../v1")), "version"),
        (
            lambda s: s.SetAlias(pb.SetAliasRequest(model="fraud", alias="Prod", version="v1")),
            "alias",
        ),
        (
            lambda s: s.DownloadArtifact(
                pb.DownloadArtifactRequest(model="fr aud", version="v1")
            ).read(),
            "model",
        ),
        (
            lambda s: s.UploadVersion(stream(requests(header(b"x", sha256="xyz"), b"x"))),
            "header.sha256",
        ),
        (
            lambda s: s.UploadVersion(stream(requests(header(b"x", version="V_1"), b"x"))),
            "header.version",
        ),
        (
            lambda s: s.UploadVersion(stream(requests(header(b"x", format="pickle"), b"x"))),
            "header.format",
        ),
        (
            lambda s: s.UploadVersion(
                stream(
                    requests(
                        header(b"x", inputs=[pb.TensorSpec(name="x", datatype="float32")]), b"x"
                    )
                )
            ),
            "header.inputs[0].datatype",
        ),
    ],
)
async def test_bad_names_and_fields_are_invalid_argument_naming_the_field(
    registry: RunningRegistry, call: Callable[[object], Awaitable[object]], field: str
) -> None:
    error = await refused(call(registry.stub))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}: "), error.details()


async def test_a_second_upload_of_a_version_with_other_bytes_already_exists(
    registry: RunningRegistry, demo1: Artifact, demo2: Artifact
) -> None:
    first = await push(registry, demo1.data)
    assert await push(registry, demo1.data) == first  # identical bytes: idempotent

    # The client asks before it streams a byte (the registry never sees this upload) ...
    error = await refused(push(registry, demo2.data))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "fraud/v1" in error.details()
    # ... and the registry refuses one that comes anyway, right after its header, in the
    # same words.
    raw = await refused(registry.stub.UploadVersion(stream(requests(header(demo2.data), b""))))
    assert (raw.code(), raw.details()) == (error.code(), error.details())
    _, data = await fetch_verified(registry.channel, "fraud", "v1")
    assert data == demo1.data
    assert temp_files(registry.store.root) == []


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        (requests(None, b"chunk first"), "must carry it"),
        ([*requests(header(b"ab"), b"a"), *requests(header(b"ab"), b"b")], "sent twice"),
        ([], "ended without one"),
    ],
    ids=["chunk-before-header", "header-twice", "empty-stream"],
)
async def test_an_out_of_order_upload_stream_is_a_failed_precondition(
    registry: RunningRegistry, messages: list[pb.UploadVersionRequest], says: str
) -> None:
    error = await refused(registry.stub.UploadVersion(stream(messages)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith("header: ") and says in error.details()
    await assert_nothing_left(registry)


async def test_a_client_cancelling_mid_upload_leaves_no_temp_file(
    registry: RunningRegistry, demo1: Artifact
) -> None:
    root = registry.store.root
    half_sent = asyncio.Event()
    never = asyncio.Event()

    async def half_then_wait() -> AsyncIterator[pb.UploadVersionRequest]:
        messages = requests(header(demo1.data), demo1.data)
        for message in messages[: len(messages) // 2]:
            yield message
        half_sent.set()
        await never.wait()

    call = registry.stub.UploadVersion(half_then_wait())
    await asyncio.wait_for(half_sent.wait(), 5)
    await wait_until_async(lambda: temp_files(root), "the server to stage the upload's file")
    call.cancel()
    await wait_until_async(lambda: not temp_files(root), "the cancelled upload's file to go")
    await assert_nothing_left(registry)


@pytest.mark.parametrize("truncate", [False, True], ids=["flipped-byte", "truncated"])
async def test_fetch_verified_raises_on_a_blob_tampered_with_on_disk(
    registry: RunningRegistry, demo1: Artifact, truncate: bool
) -> None:
    await push(registry, demo1.data)
    corrupt(blob_path(registry.store.root, demo1.sha256), truncate=truncate)

    with pytest.raises(ArtifactIntegrityError, match="fraud/v1"):
        await fetch_verified(registry.channel, "fraud", "v1")


async def test_fetch_verified_refuses_an_artifact_over_max_bytes(
    registry: RunningRegistry, demo1: Artifact
) -> None:
    await push(registry, demo1.data)
    with pytest.raises(ArtifactTooLargeError, match=str(demo1.size)):
        await fetch_verified(registry.channel, "fraud", "v1", max_bytes=demo1.size - 1)


async def test_a_version_whose_blob_vanished_is_data_loss(
    registry: RunningRegistry, demo1: Artifact
) -> None:
    await push(registry, demo1.data)
    blob_path(registry.store.root, demo1.sha256).unlink()
    error = await refused(fetch_verified(registry.channel, "fraud", "v1"))
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert "fraud/v1" in error.details()


async def test_models_are_created_listed_and_not_created_twice(
    registry: RunningRegistry, demo1: Artifact
) -> None:
    created = await registry.stub.CreateModel(
        pb.CreateModelRequest(name="churn", description="who leaves")
    )
    assert (created.name, created.description) == ("churn", "who leaves")
    error = await refused(registry.stub.CreateModel(pb.CreateModelRequest(name="churn")))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS

    await push(registry, demo1.data, "v1")  # auto-creates "fraud"
    listed = await registry.stub.ListModels(pb.ListModelsRequest())
    assert [m.name for m in listed.models] == ["churn", "fraud"]
    versions = await registry.stub.ListVersions(pb.ListVersionsRequest(model="fraud"))
    assert [v.version for v in versions.versions] == ["v1"]
    assert (await registry.stub.ListVersions(pb.ListVersionsRequest(model="churn"))).versions == []


async def test_uploads_are_logged_with_their_header_and_never_their_bytes(
    registry: RunningRegistry, demo1: Artifact, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="servemesh.registry")
    await push(registry, demo1.data)
    # Straight to the service: the client would refuse other bytes before streaming them.
    other = demo1.data + b"!"
    await refused(registry.stub.UploadVersion(stream(requests(header(other), other))))

    lines = {r.getMessage(): r for r in caplog.records if r.name == "servemesh.registry.service"}
    accepted, refusal = lines["upload accepted"], lines["upload refused"]
    assert (accepted.model, accepted.version, accepted.size_bytes, accepted.sha256) == (  # type: ignore[attr-defined]
        "fraud",
        "v1",
        demo1.size,
        demo1.sha256,
    )
    assert (refusal.model, refusal.code) == ("fraud", "ALREADY_EXISTS")  # type: ignore[attr-defined]
    for record in caplog.records:
        assert not any(isinstance(v, bytes | bytearray) for v in vars(record).values())


async def test_concurrent_uploads_of_different_versions_all_land(registry: RunningRegistry) -> None:
    payloads = {f"v{i}": bytes([i]) * (300_000 + i) for i in range(6)}
    pushed = await asyncio.gather(*(push(registry, data, v) for v, data in payloads.items()))
    assert {p.version for p in pushed} == set(payloads)
    for version, data in payloads.items():
        _, got = await fetch_verified(registry.channel, "fraud", version)
        assert got == data
    assert temp_files(registry.store.root) == []
