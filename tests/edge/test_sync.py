"""`edge sync` against a real registry on loopback, over a channel without the control
credential (a read): the first sync downloads, the next is "not modified" with no bytes,
a moved alias swaps the new file in, and a tampered or truncated download is refused with
the device's file kept."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grpc
import numpy as np
import pytest

from servemesh.edge.sync import SyncRefused, held, manifest_of, sync
from servemesh.registry.client import set_alias
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc
from tests.control_kit import TEST_CREDENTIAL
from tests.edge.conftest import EdgeRegistry, Wine
from tests.registry.registry_kit import blob_path, corrupt


def sample(registry: EdgeRegistry, name: str) -> float:
    value = registry.server.metrics.registry.get_sample_value(name)
    return float(value or 0.0)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_sync_downloads_then_not_modified_costs_no_bytes_then_swaps_a_moved_alias(
    edge_registry: EdgeRegistry, tmp_path: Path
) -> None:
    device = tmp_path / "device"
    v1 = edge_registry.store.get_version("fraud", "v1")
    v2 = edge_registry.store.get_version("fraud", "v2")
    async with grpc.aio.insecure_channel(edge_registry.address) as channel:  # no credential
        first = await sync(channel, model="fraud", alias="production", directory=device)
        assert first.changed and first.version == "v1" and first.previous_version is None
        assert first.bytes_received == v1.size_bytes
        assert first.path == device / "fraud.pt" and file_digest(first.path) == v1.sha256
        manifest = json.loads(manifest_of(device, "fraud").read_text())
        assert manifest["source"]["sha256"] == manifest["sha256"] == v1.sha256

        sent = sample(edge_registry, "servemesh_registry_download_bytes_total")
        again = await sync(channel, model="fraud", alias="production", directory=device)
        assert not again.changed and again.version == "v1"
        assert (again.bytes_received, again.messages) == (0, 1)  # one header, no chunk
        assert sample(edge_registry, "servemesh_registry_download_bytes_total") == sent
        assert sample(edge_registry, "servemesh_registry_downloads_not_modified_total") == 1

        # What the wire carries: one message, the record and the ETag, no data.
        stub = registry_pb2_grpc.RegistryStub(channel)
        answer = [
            m
            async for m in stub.DownloadArtifact(
                registry_pb2.DownloadArtifactRequest(
                    model="fraud", version="production", if_none_match=v1.sha256
                )
            )
        ]
        assert len(answer) == 1 and answer[0].not_modified and answer[0].data == b""
        assert answer[0].etag == v1.sha256 and answer[0].version.version == "v1"

        await set_alias(
            edge_registry.channel, "fraud", "production", "v2", credential=TEST_CREDENTIAL
        )
        moved = await sync(channel, model="fraud", alias="production", directory=device)
        assert moved.changed and (moved.version, moved.previous_version) == ("v2", "v1")
        assert moved.bytes_received == v2.size_bytes and file_digest(moved.path) == v2.sha256
        assert sorted(p.name for p in device.iterdir()) == ["fraud.manifest.json", "fraud.pt"]


@pytest.mark.parametrize("damage", ["tampered", "truncated"])
async def test_a_damaged_download_is_refused_and_the_held_model_stays(
    edge_registry: EdgeRegistry, tmp_path: Path, damage: str
) -> None:
    device = tmp_path / "device"
    v2 = edge_registry.store.get_version("fraud", "v2")
    async with grpc.aio.insecure_channel(edge_registry.address) as channel:
        first = await sync(channel, model="fraud", alias="production", directory=device)
        before = first.path.read_bytes()
        manifest_before = manifest_of(device, "fraud").read_text()
        # The registry's stored bytes of v2 altered on disk: what it streams is not v2.
        corrupt(blob_path(edge_registry.root, v2.sha256), truncate=damage == "truncated")
        await set_alias(
            edge_registry.channel, "fraud", "production", "v2", credential=TEST_CREDENTIAL
        )
        with pytest.raises(SyncRefused) as refused:
            await sync(channel, model="fraud", alias="production", directory=device)
    expected = "truncated download" if damage == "truncated" else "the download was altered"
    assert expected in str(refused.value)
    assert refused.value.exit_code == 1
    assert first.path.read_bytes() == before
    assert manifest_of(device, "fraud").read_text() == manifest_before
    assert held(device, "fraud") is not None
    assert sorted(p.name for p in device.iterdir()) == ["fraud.manifest.json", "fraud.pt"]


async def test_onnx_sync_exports_on_the_device_side_and_is_not_modified_next_time(
    edge_registry: EdgeRegistry, wine: Wine, tmp_path: Path
) -> None:
    from servemesh.edge.export import run_onnx

    device = tmp_path / "device"
    async with grpc.aio.insecure_channel(edge_registry.address) as channel:
        synced = await sync(
            channel, model="wine", alias="production", directory=device, format="onnx"
        )
        assert synced.changed and synced.path == device / "wine.onnx"
        manifest = json.loads(manifest_of(device, "wine").read_text())
        assert manifest["format"] == "onnx" and manifest["check"]["passed"]
        assert manifest["sha256"] == file_digest(synced.path)
        again = await sync(
            channel, model="wine", alias="production", directory=device, format="onnx"
        )
        assert not again.changed and again.bytes_received == 0
    probs, labels = run_onnx(
        synced.path.read_bytes(), {"chemistry": wine.chemistry, "tasting": wine.tasting}
    )
    assert probs.shape == (45, 3) and (labels == wine.labels).mean() >= 0.9
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
