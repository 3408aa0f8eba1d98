"""What the registry tells a caller when its disk or database fails: a status and a short
message, never a path under its state dir, a SQLite text or an OS error string."""

from __future__ import annotations

import shutil

import grpc

from servemesh.contract.demo import Artifact
from servemesh_api.registry.v1 import registry_pb2 as pb
from tests.registry.registry_kit import RunningRegistry, blob_path
from tests.registry.test_registry_service import push, refused


def _leaks(details: str, registry: RunningRegistry) -> list[str]:
    root = str(registry.store.root)
    return [s for s in (root, "/tmp", "Errno", "sqlite", "registry.db") if s in details]


async def test_a_failing_disk_is_internal_without_a_path(
    registry: RunningRegistry, demo1: Artifact
) -> None:
    tmp = registry.store.root / "tmp"
    shutil.rmtree(tmp)
    tmp.write_text("a file where the upload area was")  # staging an upload fails (ENOTDIR)
    error = await refused(push(registry, demo1.data))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "internal error"
    assert _leaks(error.details(), registry) == []


async def test_a_failing_database_is_internal_without_its_text(registry: RunningRegistry) -> None:
    await registry.stub.CreateModel(pb.CreateModelRequest(name="fraud"))
    db = registry.store._db
    assert db is not None
    db.execute("DROP TABLE versions")  # a broken database: "no such table: versions"
    error = await refused(
        registry.stub.GetVersion(pb.GetVersionRequest(model="fraud", version="v1"))
    )
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "internal error"
    assert _leaks(error.details(), registry) == []


async def test_a_missing_artifact_names_the_version_not_the_file(
    registry: RunningRegistry, demo1: Artifact
) -> None:
    record = await push(registry, demo1.data)
    blob_path(registry.store.root, record.sha256).unlink()
    call = registry.stub.DownloadArtifact(pb.DownloadArtifactRequest(model="fraud", version="v1"))
    error = await refused(_drain(call))
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert "fraud/v1" in error.details()
    assert _leaks(error.details(), registry) == []


async def _drain(call: grpc.aio.UnaryStreamCall) -> None:
    async for _ in call:
        pass
