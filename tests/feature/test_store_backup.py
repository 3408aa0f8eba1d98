"""The feature store's backup and restore against a real Redis (the session's): what a
backup holds, what a restore puts back, and that a backup that does not verify restores
nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from servemesh.features.backup import (
    DATA_FILE,
    MANIFEST_FILE,
    BackupError,
    back_up,
    read_manifest,
    restore,
)


@pytest.fixture
def store(redis_url: str) -> Iterator[tuple[redis.Redis, str]]:
    """A client and a prefix of this test's own (the session's Redis is shared)."""
    client = redis.Redis.from_url(redis_url)
    prefix = f"bk{uuid.uuid4().hex[:8]}"
    try:
        yield client, prefix
    finally:
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        client.delete(f"other{prefix}:x")
        client.close()


def fill(client: redis.Redis, prefix: str) -> None:
    client.hset(f"{prefix}:customer:v1:c-1", mapping={"age": "41", "spend": "12.5"})
    client.hset(f"{prefix}:customer:v1:c-2", mapping={"age": "23", "spend": "0"})
    client.set(f"{prefix}:customer:current", "v1")
    client.zadd(f"{prefix}:customer:versions", {"v1": 1.0})
    client.set(f"{prefix}:cache:c-1", "0.61", px=600_000)
    for n in range(1200):  # more than one batch
        client.set(f"{prefix}:bulk:{n}", str(n))


def test_a_backup_restores_every_key_with_its_type_value_and_time_to_live(
    store: tuple[redis.Redis, str], tmp_path: Path
) -> None:
    client, prefix = store
    fill(client, prefix)
    client.set(f"other{prefix}:x", "not ours")
    manifest = back_up(client, prefix, tmp_path / "bk")
    assert manifest.keys == 1205
    assert (tmp_path / "bk").stat().st_mode & 0o077 == 0
    assert (tmp_path / "bk" / DATA_FILE).stat().st_mode & 0o077 == 0
    assert read_manifest(tmp_path / "bk") == manifest

    # Lost: some keys deleted, one changed; one written after the backup.
    client.delete(f"{prefix}:customer:v1:c-1", f"{prefix}:cache:c-1", f"{prefix}:bulk:7")
    client.set(f"{prefix}:customer:current", "v9")
    client.set(f"{prefix}:customer:v2:c-3", "new")
    done = restore(client, tmp_path / "bk", prefix=prefix)
    assert done.keys == 1205 and done.age_s >= 0
    assert client.hgetall(f"{prefix}:customer:v1:c-1") == {b"age": b"41", b"spend": b"12.5"}
    assert client.get(f"{prefix}:customer:current") == b"v1"
    assert client.zscore(f"{prefix}:customer:versions", "v1") == 1.0
    assert client.get(f"{prefix}:bulk:7") == b"7"
    assert 0 < client.pttl(f"{prefix}:cache:c-1") <= 600_000
    assert client.pttl(f"{prefix}:customer:current") == -1  # no expiry stays none
    # Written after the backup, and not the store's: left as they are.
    assert client.get(f"{prefix}:customer:v2:c-3") == b"new"
    assert client.get(f"other{prefix}:x") == b"not ours"


def test_a_backup_whose_file_changed_restores_nothing(
    store: tuple[redis.Redis, str], tmp_path: Path
) -> None:
    client, prefix = store
    fill(client, prefix)
    back_up(client, prefix, tmp_path / "bk")
    client.delete(f"{prefix}:customer:v1:c-1")
    data = tmp_path / "bk" / DATA_FILE
    lines = data.read_bytes().splitlines(keepends=True)
    data.write_bytes(b"".join(lines[:-1]))  # one key short
    with pytest.raises(BackupError, match="sha256"):
        restore(client, tmp_path / "bk", prefix=prefix)
    assert client.exists(f"{prefix}:customer:v1:c-1") == 0  # nothing was written


def test_a_manifest_that_agrees_with_a_damaged_file_still_restores_nothing(
    store: tuple[redis.Redis, str], tmp_path: Path
) -> None:
    """A file edited and its manifest's sha256 made to match: each line is still checked
    (and Redis checks each payload's own checksum) before anything is written."""
    import hashlib

    client, prefix = store
    fill(client, prefix)
    back_up(client, prefix, tmp_path / "bk")
    client.delete(f"{prefix}:customer:v1:c-2")
    data = tmp_path / "bk" / DATA_FILE
    damaged = data.read_bytes() + b'{"key": "not base64!", "ttl_ms": 0, "dump": ""}\n'
    data.write_bytes(damaged)
    manifest_path = tmp_path / "bk" / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["sha256"] = hashlib.sha256(damaged).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(BackupError, match="not a backed-up key"):
        restore(client, tmp_path / "bk", prefix=prefix)
    assert client.exists(f"{prefix}:customer:v1:c-2") == 0


def test_another_store_s_backup_is_refused(store: tuple[redis.Redis, str], tmp_path: Path) -> None:
    client, prefix = store
    fill(client, prefix)
    back_up(client, prefix, tmp_path / "bk")
    with pytest.raises(BackupError, match="under"):
        restore(client, tmp_path / "bk", prefix="fs")
    with pytest.raises(BackupError, match="no manifest.json"):
        restore(client, tmp_path, prefix=prefix)
