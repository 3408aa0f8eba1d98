"""Registry backups against a real store and a real registry server on loopback: a
snapshot taken while uploads go on is consistent and copies only what is new; a damaged
backup is refused naming each fault, and nothing is restored; a restore into an empty
registry brings every model, version (sha256, labels, lineage) and alias back through the
API, and a registry that is not empty is refused unless only what it lacks is asked for
(then a version it holds with other bytes refuses the whole restore); pruning keeps the
newest; the schedule takes snapshots on its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from servemesh.contract.demo import Artifact
from servemesh.registry.app import registry_server
from servemesh.registry.backup import (
    BackupDamaged,
    RestoreRefused,
    backup_every,
    blob_path,
    check_snapshot,
    read_manifest,
    restore,
    snapshots,
    take_backup,
)
from servemesh.registry.client import push_version, set_alias
from servemesh.registry.store import RegistryStore
from tests.control_kit import TEST_CREDENTIAL, TEST_TOKEN, credentialed_channel
from tests.registry.registry_kit import INPUTS, MAX_ARTIFACT_BYTES, OUTPUTS, RunningRegistry
from tests.waiting import wait_until_async


@asynccontextmanager
async def another_registry(root: Path) -> AsyncIterator[tuple[RegistryStore, grpc.aio.Channel]]:
    """A second registry server on an empty store, and a credentialed channel to it."""
    store = RegistryStore(root, MAX_ARTIFACT_BYTES)
    server = registry_server(store, "registry-other", port=0, control_token=TEST_TOKEN)
    channel = credentialed_channel(f"127.0.0.1:{await server.start()}")
    try:
        yield store, channel
    finally:
        await channel.close()
        await server.drain()


async def push(registry: RunningRegistry, model: str, version: str, art: Artifact) -> None:
    await push_version(
        registry.channel, model=model, version=version, data=art.data, inputs=INPUTS,
        outputs=OUTPUTS, credential=TEST_CREDENTIAL, labels={"source": version},
        lineage={"run": f"run-{version}"}, metrics={"auc": 0.9},
    )  # fmt: skip


async def seeded(registry: RunningRegistry, demo1: Artifact, demo2: Artifact) -> None:
    await push(registry, "fraud", "v1", demo1)
    await push(registry, "fraud", "v2", demo2)
    await push(registry, "churn", "v1", demo1)  # the same bytes: one artifact
    await set_alias(registry.channel, "fraud", "stable", "v1", credential=TEST_CREDENTIAL)


async def test_a_snapshot_while_uploads_go_on_is_whole_and_copies_only_new_artifacts(
    registry: RunningRegistry, demo1: Artifact, demo2: Artifact, tmp_path: Path
) -> None:
    out = tmp_path / "backups"
    await seeded(registry, demo1, demo2)
    first = await asyncio.to_thread(take_backup, registry.store.root, out)
    assert first.names() == ["fraud/v1", "fraud/v2", "churn/v1"]
    assert first.new_blobs == 2 and first.aliases == {"fraud": {"stable": "v1"}}
    # Backups taken on another thread while more versions arrive: each one is some moment
    # of the store, whole.
    taken = []
    stop = threading.Event()

    def keep_backing_up() -> None:
        while not stop.is_set():
            taken.append(take_backup(registry.store.root, out))

    worker = threading.Thread(target=keep_backing_up)
    worker.start()
    try:
        for i in range(6):
            await push(registry, "fraud", f"v{3 + i}", demo1 if i % 2 else demo2)
    finally:
        stop.set()
        await asyncio.to_thread(worker.join)
    assert taken, "no backup finished while the uploads ran"
    for manifest in taken:
        assert check_snapshot(out, manifest.snapshot) == []
        assert manifest.names()[:3] == first.names()
    last = await asyncio.to_thread(take_backup, registry.store.root, out)
    assert len(last.versions) == 9
    assert last.new_blobs == 0  # both artifacts were in the folder already
    assert snapshots(out)[-1] == last.snapshot


async def test_a_damaged_backup_is_refused_naming_each_fault(
    registry: RunningRegistry, demo1: Artifact, demo2: Artifact, tmp_path: Path
) -> None:
    out = tmp_path / "backups"
    await seeded(registry, demo1, demo2)
    manifest = await asyncio.to_thread(take_backup, registry.store.root, out)
    flipped = blob_path(out, demo1.sha256)
    data = bytearray(flipped.read_bytes())
    data[100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    blob_path(out, demo2.sha256).unlink()
    problems = check_snapshot(out, manifest.snapshot)
    assert any(p.startswith("fraud/v1: artifact sha256") for p in problems), problems
    assert any(p.startswith("churn/v1: artifact sha256") for p in problems), problems
    assert f"fraud/v2: artifact {demo2.sha256} missing" in problems
    async with another_registry(tmp_path / "empty") as (empty, channel):
        with pytest.raises(BackupDamaged, match="nothing restored") as refused:
            await restore(out, None, channel, TEST_CREDENTIAL, max_artifact_bytes=1 << 22)
        assert "fraud/v2" in str(refused.value)
        assert empty.list_models() == []


async def test_a_restore_brings_every_version_and_alias_back_into_an_empty_registry(
    registry: RunningRegistry, demo1: Artifact, demo2: Artifact, tmp_path: Path
) -> None:
    out = tmp_path / "backups"
    await seeded(registry, demo1, demo2)
    await asyncio.to_thread(take_backup, registry.store.root, out)
    # Not into a registry that holds models.
    with pytest.raises(RestoreRefused, match="not empty"):
        await restore(out, None, registry.channel, TEST_CREDENTIAL, max_artifact_bytes=1 << 22)

    async with another_registry(tmp_path / "fresh") as (empty, channel):
        done = await restore(out, None, channel, TEST_CREDENTIAL, max_artifact_bytes=1 << 22)
        assert (done.models, done.versions, done.aliases) == (2, 3, 1)
        assert [m.name for m in empty.list_models()] == ["churn", "fraud"]
        assert empty.get_model("fraud").aliases == {"stable": "v1"}
        before = registry.store.list_versions("fraud")
        after = empty.list_versions("fraud")
        keep = ("version", "sha256", "size_bytes", "format", "labels", "lineage", "metrics")
        assert [tuple(getattr(r, k) for k in keep) for r in after] == [
            tuple(getattr(r, k) for k in keep) for r in before
        ]
        with empty.open_artifact(after[1]) as handle:
            assert handle.read() == demo2.data


async def test_missing_only_puts_back_what_a_registry_lacks_and_refuses_other_bytes(
    registry: RunningRegistry, demo1: Artifact, demo2: Artifact, tmp_path: Path
) -> None:
    out = tmp_path / "backups"
    await seeded(registry, demo1, demo2)
    await asyncio.to_thread(take_backup, registry.store.root, out)
    async with another_registry(tmp_path / "partial") as (partial, channel):
        # It lost churn and fraud/v2, and its stable alias moved on since the snapshot.
        await push_version(
            channel, model="fraud", version="v1", data=demo1.data, inputs=INPUTS,
            outputs=OUTPUTS, credential=TEST_CREDENTIAL,
        )  # fmt: skip
        await push_version(
            channel, model="fraud", version="v9", data=demo2.data, inputs=INPUTS,
            outputs=OUTPUTS, credential=TEST_CREDENTIAL,
        )  # fmt: skip
        await set_alias(channel, "fraud", "stable", "v9", credential=TEST_CREDENTIAL)
        done = await restore(
            out, None, channel, TEST_CREDENTIAL, max_artifact_bytes=1 << 22, missing_only=True
        )
        assert (done.versions, done.already_there, done.aliases) == (2, 1, 0)
        assert done.aliases_kept == ["fraud@stable -> v9"]
        assert [m.name for m in partial.list_models()] == ["churn", "fraud"]
        assert sorted(r.version for r in partial.list_versions("fraud")) == ["v1", "v2", "v9"]
        assert partial.get_model("fraud").aliases == {"stable": "v9"}
        again = await restore(
            out, None, channel, TEST_CREDENTIAL, max_artifact_bytes=1 << 22, missing_only=True
        )
        assert (again.versions, again.already_there) == (0, 3)

    async with another_registry(tmp_path / "other") as (other, channel):
        # The same name with other bytes: refused before anything is written.
        await push_version(
            channel, model="fraud", version="v2", data=demo1.data, inputs=INPUTS,
            outputs=OUTPUTS, credential=TEST_CREDENTIAL,
        )  # fmt: skip
        with pytest.raises(RestoreRefused, match="fraud/v2: the registry holds sha256"):
            await restore(
                out, None, channel, TEST_CREDENTIAL, max_artifact_bytes=1 << 22, missing_only=True
            )
        assert [m.name for m in other.list_models()] == ["fraud"]
        assert [r.version for r in other.list_versions("fraud")] == ["v2"]


async def test_pruning_keeps_the_newest_and_the_artifacts_they_name(
    registry: RunningRegistry, demo1: Artifact, demo2: Artifact, tmp_path: Path
) -> None:
    out = tmp_path / "backups"
    await push(registry, "fraud", "v1", demo1)
    old = await asyncio.to_thread(take_backup, registry.store.root, out)
    await push(registry, "churn", "v1", demo2)
    await asyncio.to_thread(take_backup, registry.store.root, out)
    # An artifact no snapshot names (one whose snapshot was deleted by hand, say).
    stray = blob_path(out, "ab" * 32)
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"left over")
    newest = await asyncio.to_thread(take_backup, registry.store.root, out, keep=2)
    assert newest.pruned == [old.snapshot]
    assert snapshots(out)[-1] == newest.snapshot and len(snapshots(out)) == 2
    assert blob_path(out, demo1.sha256).is_file() and blob_path(out, demo2.sha256).is_file()
    assert not stray.exists()
    assert read_manifest(out, newest.snapshot).names() == ["fraud/v1", "churn/v1"]


async def test_the_schedule_takes_snapshots_on_its_own(
    registry: RunningRegistry, demo1: Artifact, tmp_path: Path
) -> None:
    out = tmp_path / "scheduled"
    await push(registry, "fraud", "v1", demo1)
    task = asyncio.create_task(backup_every(0.05, registry.store.root, out, keep=2))
    try:
        await wait_until_async(lambda: len(snapshots(out)) >= 2, "two scheduled snapshots")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert len(snapshots(out)) == 2  # keep=2 pruned the rest
    assert read_manifest(out, snapshots(out)[-1]).names() == ["fraud/v1"]
