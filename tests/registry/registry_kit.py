"""Helpers the registry tests share: signatures, headers, and what a store leaves on disk."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from servemesh.registry.records import TensorSpec, UploadHeader
from servemesh.registry.store import RegistryStore
from servemesh.services.runtime import ServiceServer
from servemesh_api.registry.v1 import registry_pb2_grpc

# Above the demo artifact (~1.2 MB), small enough that crossing it streams quickly.
MAX_ARTIFACT_BYTES = 4 * 1024 * 1024

INPUTS = (TensorSpec("features", "FP32", (-1, 64)),)
OUTPUTS = (TensorSpec("score", "FP32", (-1, 1)),)


@dataclass
class RunningRegistry:
    """An in-process registry server on 127.0.0.1 and a channel to it."""

    store: RegistryStore
    server: ServiceServer
    channel: grpc.aio.Channel
    stub: registry_pb2_grpc.RegistryStub
    address: str = ""  # host:port it listens on


def header_for(
    data: bytes, model: str = "fraud", version: str = "v1", **changes: Any
) -> UploadHeader:
    """A valid header declaring `data`; `changes` override any field."""
    header = UploadHeader(
        model=model,
        version=version,
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        format="torchscript",
        inputs=INPUTS,
        outputs=OUTPUTS,
        labels={"source": "test"},
    )
    return replace(header, **changes)


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "tmp").rglob("*") if p.is_file())


def blob_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "blobs").rglob("*") if p.is_file())


def blob_path(root: Path, sha256: str) -> Path:
    return root / "blobs" / "sha256" / sha256[:2] / sha256


def corrupt(path: Path, *, truncate: bool = False) -> None:
    """Damage a stored blob in place (it is read-only, as the store leaves it)."""
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    if truncate:
        del data[-1]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
