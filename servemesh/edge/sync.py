"""Keep a device's copy of an alias's artifact current: `servemesh edge sync`.

The device asks the registry's DownloadArtifact for the alias with the sha256 it holds as
`if_none_match` (the artifact's ETag). The registry answers "not modified" in one message
without a byte when that is still the alias's version; otherwise it streams the artifact,
which is written to a temporary file beside the current one while it is hashed, and:

- refused, the temporary file removed and the current file left as it was, when the stream
  carries more or fewer bytes than the version record's size, or bytes whose sha256 is not
  the record's (a truncated or tampered download);
- else flushed to disk (fsync) and renamed over the current file (one rename: a reader sees
  the old file or the new one, never half of either), then the manifest rewritten the same
  way, and the folder fsynced.

In the folder (`--dir`), for model M: the model file (`M.pt2` or `M.pt`, the registry's
artifact as stored; `M.onnx` with `--format onnx`, exported on the device side of the sync
and checked in onnxruntime before it is swapped in, `servemesh.edge.export`) and
`M.manifest.json`: the source version, its sha256 (the ETag sent next time), the file and
its own sha256. A file that no longer matches its manifest is downloaded again.

The call is a read: no control credential, over the registry's mTLS as every read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc

from servemesh.contract.atomic import atomic_write_bytes
from servemesh.contract.digests import file_sha256
from servemesh.contract.errors import ServemeshError
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

__all__ = [
    "SYNC_FORMATS",
    "SyncError",
    "SyncRefused",
    "Synced",
    "held",
    "sync",
]

SyncFormat = Literal["artifact", "onnx"]
SYNC_FORMATS: tuple[SyncFormat, ...] = ("artifact", "onnx")
FILE_MODE = 0o644


class SyncError(ServemeshError):
    """The sync could not be made (the registry refused, the folder is unusable)."""


class SyncRefused(SyncError):
    """What arrived is not the version's artifact: refused, the device's file kept."""


@dataclass(frozen=True)
class Synced:
    """What one sync did: `changed` False is "not modified" (no bytes received)."""

    model: str
    alias: str
    version: str
    sha256: str  # the source artifact's: the ETag
    path: Path
    changed: bool
    bytes_received: int
    messages: int
    previous_version: str | None
    format: SyncFormat


def manifest_of(directory: Path, model: str) -> Path:
    return directory / f"{model}.manifest.json"


def held(directory: Path, model: str) -> dict[str, Any] | None:
    """The manifest of what the folder holds for `model`, when its file is there and still
    hashes to the manifest's sha256; None otherwise (nothing held, or damaged)."""
    try:
        manifest = json.loads(manifest_of(directory, model).read_text())
        path = directory / str(manifest["file"])
        if Path(manifest["file"]).name != manifest["file"]:
            return None
        if file_sha256(path) != manifest["sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dict(manifest)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _Received:
    record: registry_pb2.ModelVersion | None = None
    not_modified: bool = False
    size: int = 0
    messages: int = 0


async def _download(
    stub: registry_pb2_grpc.RegistryStub,
    model: str,
    alias: str,
    etag: str,
    handle: Any,
    *,
    timeout: float,
    max_bytes: int | None,
) -> _Received:
    """Stream the alias's artifact into `handle`, checking size and sha256 as it comes."""
    call = stub.DownloadArtifact(
        registry_pb2.DownloadArtifactRequest(model=model, version=alias, if_none_match=etag),
        timeout=timeout,
    )
    got = _Received()
    digest = hashlib.sha256()
    try:
        async for message in call:
            got.messages += 1
            if got.record is None:
                if not message.HasField("version"):
                    raise SyncRefused(f"{model} {alias}: the first message carries no record")
                got.record = message.version
                if got.record.model != model:
                    raise SyncRefused(
                        f"{model} {alias}: the registry answered for model {got.record.model!r}"
                    )
                if message.etag and message.etag != got.record.sha256:
                    raise SyncRefused(f"{model} {alias}: the ETag is not the record's sha256")
                if message.not_modified:
                    got.not_modified = True
                    if message.data or got.record.sha256 != etag:
                        raise SyncRefused(f"{model} {alias}: a not-modified answer that is not")
                    continue
                if max_bytes is not None and got.record.size_bytes > max_bytes:
                    raise SyncRefused(
                        f"{model} {alias}: {got.record.size_bytes} bytes is over the "
                        f"{max_bytes} allowed"
                    )
            elif got.not_modified:
                raise SyncRefused(f"{model} {alias}: bytes after a not-modified answer")
            got.size += len(message.data)
            if got.size > got.record.size_bytes:
                raise SyncRefused(
                    f"{model} {alias}: more bytes than the record's size_bytes "
                    f"({got.record.size_bytes})"
                )
            digest.update(message.data)
            handle.write(message.data)
    except grpc.aio.AioRpcError as exc:
        raise SyncError(
            " ".join(f"{model} {alias}: the registry: {exc.code().name}: {exc.details()}".split())
        ) from None
    finally:
        call.cancel()
    if got.record is None:
        raise SyncRefused(f"{model} {alias}: the download stream was empty")
    if got.not_modified:
        return got
    if got.size != got.record.size_bytes:
        raise SyncRefused(
            f"{model} {alias}: truncated download: {got.size} of {got.record.size_bytes} bytes"
        )
    if digest.hexdigest() != got.record.sha256:
        raise SyncRefused(
            f"{model} {alias}: sha256 {digest.hexdigest()} is not the record's "
            f"{got.record.sha256}: the download was altered"
        )
    return got


def _artifact_name(model: str, record: registry_pb2.ModelVersion, format: SyncFormat) -> str:
    if format == "onnx" or record.format == "onnx":
        return f"{model}.onnx"
    return f"{model}.pt2" if record.format == "torch_export" else f"{model}.pt"


async def sync(
    channel: grpc.aio.Channel,
    *,
    model: str,
    alias: str,
    directory: Path,
    format: SyncFormat = "artifact",
    timeout: float = 120.0,
    max_bytes: int | None = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> Synced:
    """Bring `directory`'s copy of `model` to the version `alias` names (see the module).

    Raises SyncRefused (the held file untouched) when the download is not the version's
    artifact or its ONNX export does not answer as the original, SyncError when the
    registry refuses (an unknown model or alias) or the folder cannot be written.
    """
    if format not in SYNC_FORMATS:
        raise SyncError(f"format {format!r} is not one of {list(SYNC_FORMATS)}")
    directory.mkdir(parents=True, exist_ok=True)
    current = held(directory, model)
    previous = str(current["source"]["version"]) if current else None
    same_format = current is not None and current.get("sync_format") == format
    etag = str(current["source"]["sha256"]) if current and same_format else ""
    stub = registry_pb2_grpc.RegistryStub(channel)
    fd, part_name = tempfile.mkstemp(dir=directory, prefix=f".{model}.", suffix=".part")
    part = Path(part_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            got = await _download(
                stub, model, alias, etag, handle, timeout=timeout, max_bytes=max_bytes
            )
            handle.flush()
            os.fsync(handle.fileno())
            os.fchmod(handle.fileno(), FILE_MODE)
        record = got.record
        assert record is not None
        if got.not_modified:
            if current is None:
                raise SyncRefused(f"{model} {alias}: not modified, but nothing is held here")
            return Synced(
                model=model,
                alias=alias,
                version=record.version,
                sha256=record.sha256,
                path=directory / str(current["file"]),
                changed=False,
                bytes_received=0,
                messages=got.messages,
                previous_version=previous,
                format=format,
            )
        name = _artifact_name(model, record, format)
        target = directory / name
        manifest: dict[str, Any] = {
            "file": name,
            "sync_format": format,
            "alias": alias,
            "source": {
                "model": model,
                "version": record.version,
                "sha256": record.sha256,
                "format": record.format,
            },
            "inputs": [_tensor_json(t) for t in record.inputs],
            "outputs": [_tensor_json(t) for t in record.outputs],
        }
        if format == "onnx" and record.format != "onnx":  # an ONNX version is its own file
            exported = await _export_onnx(part, record, name, atol, rtol)
            atomic_write_bytes(target, exported.data, mode=FILE_MODE)
            manifest.update(
                format="onnx",
                sha256=exported.sha256,
                size_bytes=len(exported.data),
                check=exported.manifest(name)["check"],
            )
        else:
            os.replace(part, target)
            manifest.update(format=record.format, sha256=record.sha256, size_bytes=got.size)
        text = json.dumps(manifest, indent=2) + "\n"
        atomic_write_bytes(manifest_of(directory, model), text.encode(), mode=FILE_MODE)
        if current is not None and current["file"] != name:
            (directory / str(current["file"])).unlink(missing_ok=True)
        _fsync_dir(directory)
    finally:
        with contextlib.suppress(FileNotFoundError):
            part.unlink()
    return Synced(
        model=model,
        alias=alias,
        version=record.version,
        sha256=record.sha256,
        path=target,
        changed=True,
        bytes_received=got.size,
        messages=got.messages,
        previous_version=previous,
        format=format,
    )


def _tensor_json(spec: registry_pb2.TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


async def _export_onnx(
    part: Path,
    record: registry_pb2.ModelVersion,
    name: str,
    atol: float | None,
    rtol: float | None,
) -> Any:
    """The verified download as ONNX, checked in onnxruntime (torch on the syncing side)."""
    import asyncio

    from servemesh.edge.export import DEFAULT_ATOL, DEFAULT_RTOL, ExportError, export_version

    data = part.read_bytes()
    try:
        return await asyncio.to_thread(
            export_version,
            data,
            record,
            "onnx",
            atol=DEFAULT_ATOL if atol is None else atol,
            rtol=DEFAULT_RTOL if rtol is None else rtol,
            target=name,
        )
    except ExportError as exc:
        raise SyncRefused(str(exc)) from None
