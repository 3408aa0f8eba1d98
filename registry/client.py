"""Async helpers for talking to the registry over a grpc.aio channel.

RPC failures surface as grpc.aio.AioRpcError carrying the registry's status code (see
servemesh.registry.service for which code means what).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Union

import grpc

from servemesh.contract.control_credential import Metadata
from servemesh.contract.errors import ServemeshError
from servemesh.registry.convert import tensor_spec_to_proto
from servemesh.registry.errors import ArtifactTooLargeError, version_taken
from servemesh.registry.records import TensorSpec
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

__all__ = [
    "ArtifactIntegrityError",
    "ArtifactTooLargeError",
    "TensorSpecLike",
    "fetch_verified",
    "push_version",
    "set_alias",
]

DEFAULT_CHUNK_BYTES = 256 * 1024

# A signature tensor as a proto, a record, {"name", "datatype", "shape"} or a 3-tuple.
TensorSpecLike = Union[
    registry_pb2.TensorSpec, TensorSpec, Mapping[str, Any], tuple[str, str, Sequence[int]]
]


class ArtifactIntegrityError(ServemeshError):
    """Downloaded bytes do not match their version record (size or sha256)."""


def _tensor_proto(spec: TensorSpecLike) -> registry_pb2.TensorSpec:
    if isinstance(spec, registry_pb2.TensorSpec):
        return spec
    if isinstance(spec, TensorSpec):
        return tensor_spec_to_proto(spec)
    if isinstance(spec, Mapping):
        return registry_pb2.TensorSpec(
            name=spec["name"], datatype=spec["datatype"], shape=list(spec["shape"])
        )
    name, datatype, shape = spec
    return registry_pb2.TensorSpec(name=name, datatype=datatype, shape=list(shape))


async def push_version(
    channel: grpc.aio.Channel,
    *,
    model: str,
    version: str,
    data: bytes,
    inputs: Sequence[TensorSpecLike],
    outputs: Sequence[TensorSpecLike],
    credential: Metadata,
    labels: Mapping[str, str] | None = None,
    lineage: Mapping[str, str] | None = None,
    metrics: Mapping[str, float] | None = None,
    format: str = "torchscript",
    chunk_size: int = DEFAULT_CHUNK_BYTES,
    timeout: float = 60.0,
) -> registry_pb2.ModelVersion:
    """Upload an artifact as model/version (the model is created if new).

    `format` is "torchscript" or "torch_export" (registry.validation.FORMATS).
    `credential` is the mesh's control call metadata (`control_credential.control_metadata`).

    Returns the stored version; re-pushing identical bytes returns the existing version.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    # Hashing hundreds of MB takes a while; keep it off the event loop.
    sha256 = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
    header = registry_pb2.UploadHeader(
        model=model,
        version=version,
        sha256=sha256,
        size_bytes=len(data),
        format=format,
        inputs=[_tensor_proto(spec) for spec in inputs],
        outputs=[_tensor_proto(spec) for spec in outputs],
        labels=dict(labels or {}),
        lineage=dict(lineage or {}),
        metrics=dict(metrics or {}),
    )

    async def messages() -> AsyncIterator[registry_pb2.UploadVersionRequest]:
        yield registry_pb2.UploadVersionRequest(header=header)
        view = memoryview(data)
        for start in range(0, len(data), chunk_size):
            yield registry_pb2.UploadVersionRequest(chunk=bytes(view[start : start + chunk_size]))

    stub = registry_pb2_grpc.RegistryStub(channel)
    await _refuse_a_taken_name(stub, model, version, sha256, credential, timeout)
    return await stub.UploadVersion(messages(), timeout=timeout, metadata=credential)


async def _refuse_a_taken_name(
    stub: registry_pb2_grpc.RegistryStub,
    model: str,
    version: str,
    sha256: str,
    credential: Metadata,
    timeout: float,
) -> None:
    """Raise the registry's ALREADY_EXISTS before any byte is streamed when the version
    exists with other bytes.

    The registry refuses such an upload right after its header, while the client may still
    be writing chunks; grpcio then sometimes reports its own failed write (INTERNAL,
    "Failed execute_batch") over the server's status. Asking first keeps the answer the
    registry's; the registry's own check after the header still decides a race with
    another uploader.
    """
    try:
        existing = await stub.GetVersion(
            registry_pb2.GetVersionRequest(model=model, version=version),
            timeout=timeout,
            metadata=credential,
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return  # a new version (or model): nothing to refuse
        raise
    if existing.version == version and existing.sha256 != sha256:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.ALREADY_EXISTS,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=version_taken(model, version, existing.sha256),
        )


async def fetch_verified(
    channel: grpc.aio.Channel,
    model: str,
    version: str,
    timeout: float = 60.0,
    max_bytes: int | None = None,
) -> tuple[registry_pb2.ModelVersion, bytes]:
    """Download a version (or alias) and check its bytes against the version record.

    Returns the record and the artifact bytes. Raises ArtifactIntegrityError when the size
    or sha256 differ from the record, ArtifactTooLargeError when the record declares more
    than `max_bytes` (checked before the bytes are fetched).
    """
    stub = registry_pb2_grpc.RegistryStub(channel)
    call = stub.DownloadArtifact(
        registry_pb2.DownloadArtifactRequest(model=model, version=version), timeout=timeout
    )
    record: registry_pb2.ModelVersion | None = None
    chunks: list[bytes] = []
    received = 0
    try:
        async for message in call:
            if record is None:
                if not message.HasField("version"):
                    raise ArtifactIntegrityError(
                        f"{model}/{version}: the first chunk carries no version record"
                    )
                record = message.version
                if record.model != model:
                    raise ArtifactIntegrityError(
                        f"{model}/{version}: the registry answered for model {record.model!r}"
                    )
                if max_bytes is not None and record.size_bytes > max_bytes:
                    raise ArtifactTooLargeError(
                        f"{model}/{record.version} is {record.size_bytes} bytes, more than "
                        f"the {max_bytes} allowed"
                    )
            received += len(message.data)
            if received > record.size_bytes:
                # Stop at once rather than buffer an unbounded stream.
                raise ArtifactIntegrityError(
                    f"{model}/{record.version}: more bytes than the record's size_bytes "
                    f"({record.size_bytes})"
                )
            chunks.append(message.data)
    finally:
        # Stops the server's stream when we bail out early; a no-op once it completed.
        call.cancel()
    if record is None:
        raise ArtifactIntegrityError(f"{model}/{version}: the download stream was empty")
    if received != record.size_bytes:
        raise ArtifactIntegrityError(
            f"{model}/{record.version}: received {received} bytes, the record says "
            f"{record.size_bytes}"
        )
    data = b"".join(chunks)
    digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
    if digest != record.sha256:
        raise ArtifactIntegrityError(
            f"{model}/{record.version}: sha256 {digest} does not match the record's {record.sha256}"
        )
    return record, data


async def set_alias(
    channel: grpc.aio.Channel,
    model: str,
    alias: str,
    version: str,
    *,
    credential: Metadata,
    timeout: float = 10.0,
) -> registry_pb2.Model:
    """Point `alias` at `version` (a version or another alias); returns the model.
    `credential` is the mesh's control call metadata."""
    stub = registry_pb2_grpc.RegistryStub(channel)
    return await stub.SetAlias(
        registry_pb2.SetAliasRequest(model=model, alias=alias, version=version),
        timeout=timeout,
        metadata=credential,
    )
