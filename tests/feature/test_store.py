"""The versioned store against a real Redis: readers see one whole version at a time, a
swap is seen by every replica's next read, and nothing of a failed load stays."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

from servemesh.services.feature.store import (
    DELETE_BATCH,
    LoadInProgress,
    LoadLost,
    RedisFeatureStore,
    VersionMoved,
    pack_rows,
)

FEATURES = ["a", "b"]


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


async def keys(client: aioredis.Redis, prefix: str) -> set[str]:
    return {k.decode() async for k in client.scan_iter(match=f"{prefix}:*")}


async def load(store: RedisFeatureStore, n: int, value: float, view: str = "v") -> int:
    """Replace `view` with entities e-0..e-(n-1), every value `value`; the new version."""
    staged = await store.begin_load(view, FEATURES, "test")
    ids = [f"e-{i}" for i in range(n)]
    await staged.add(ids, np.full((n, 2), value, dtype=np.float32), np.ones(n, dtype=np.int64))
    return (await staged.commit()).version


async def test_readers_see_the_old_version_until_the_commit_then_the_new_one(
    client: aioredis.Redis, prefix: str
) -> None:
    store = RedisFeatureStore(client, prefix)
    await load(store, 3, 1.0)
    staged = await store.begin_load("v", FEATURES, "test")
    await staged.add(["e-0", "e-1"], np.full((2, 2), 2.0, np.float32), np.ones(2, np.int64))
    version, rows = await store.read("v", ["e-0", "e-2"])
    assert version is not None and version.version == 1 and rows is not None
    assert rows.values.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    await staged.commit()
    version, rows = await store.read("v", ["e-0", "e-2"])
    assert version is not None and version.version == 2 and rows is not None
    assert rows.present.tolist() == [True, False]
    assert rows.values[0].tolist() == [2.0, 2.0]


async def test_a_swap_by_another_replica_is_seen_by_the_next_read_without_a_refresh(
    client: aioredis.Redis, redis_url: str, prefix: str
) -> None:
    reader = RedisFeatureStore(client, prefix)
    other = aioredis.Redis.from_url(redis_url)
    writer = RedisFeatureStore(other, prefix)  # another replica: a cache of its own
    try:
        await load(writer, 2, 1.0)
        version, _ = await reader.read("v", ["e-0"])
        assert version is not None and version.version == 1  # now cached by the reader
        await load(writer, 2, 5.0)  # swaps to version 2 and deletes version 1
        version, rows = await reader.read("v", ["e-0", "e-1"])
        assert version is not None and version.version == 2 and rows is not None
        assert rows.values.tolist() == [[5.0, 5.0], [5.0, 5.0]]
        assert (await reader.current("v")) == version
    finally:
        await other.aclose()


async def test_a_read_is_one_round_trip_while_the_version_stays(
    client: aioredis.Redis, prefix: str
) -> None:
    store = RedisFeatureStore(client, prefix)
    await load(store, 4, 1.0)
    await store.read("v", ["e-0"])  # caches the version
    info = await client.info("commandstats")
    calls_before = {k: v["calls"] for k, v in info.items()}
    await store.read("v", ["e-0", "e-1", "e-2"])
    info = await client.info("commandstats")
    calls_after = {k: v["calls"] for k, v in info.items()}
    changed = {k: calls_after[k] - calls_before.get(k, 0) for k in calls_after}
    # One MGET (plus the INFO that measured it); no GET of the pointer, no metadata read.
    assert changed.get("cmdstat_mget") == 1
    assert not changed.get("cmdstat_get") and not changed.get("cmdstat_hget")


async def test_old_versions_are_deleted_after_the_swap_in_batches(
    client: aioredis.Redis, prefix: str
) -> None:
    store = RedisFeatureStore(client, prefix)
    n = 2 * DELETE_BATCH + 17
    await load(store, n, 1.0)
    staged = await store.begin_load("v", FEATURES, "test")
    await staged.add(["only"], np.zeros((1, 2), np.float32), np.ones(1, np.int64))
    result = await staged.commit()
    assert (result.version, result.replaced, result.deleted_keys) == (2, 1, n)
    assert await keys(client, prefix) == {
        f"{prefix}:v:seq",
        f"{prefix}:v:current",
        f"{prefix}:v:versions",
        f"{prefix}:v@2",
        f"{prefix}:v@2:only",
    }


async def test_an_aborted_load_leaves_nothing_and_frees_the_view(
    client: aioredis.Redis, prefix: str
) -> None:
    store = RedisFeatureStore(client, prefix)
    await load(store, 2, 1.0)
    before = await keys(client, prefix)
    staged = await store.begin_load("v", FEATURES, "test")
    await staged.add(["e-0", "x"], np.zeros((2, 2), np.float32), np.ones(2, np.int64))
    await staged.abort()
    assert await keys(client, prefix) == before
    assert await load(store, 1, 3.0) == 3  # the lease is free again


async def test_one_load_at_a_time_and_a_dead_loads_rows_are_cleaned_up_by_the_next(
    client: aioredis.Redis, prefix: str
) -> None:
    store = RedisFeatureStore(client, prefix)
    dead = await store.begin_load("v", FEATURES, "test")
    await dead.add(["e-0"], np.zeros((1, 2), np.float32), np.ones(1, np.int64))
    with pytest.raises(LoadInProgress, match="another load"):
        await store.begin_load("v", FEATURES, "test")
    # The loader dies; its lease runs out (removed here instead of waiting a minute).
    await client.delete(store.view_key("v", "load"))
    version = await load(store, 1, 2.0)
    assert {k for k in await keys(client, prefix) if "@" in k} == {
        f"{prefix}:v@{version}",
        f"{prefix}:v@{version}:e-0",
    }
    with pytest.raises(LoadLost):  # the dead load cannot come back and swap
        await dead.commit()


async def test_duplicate_entities_in_a_load_are_reported_not_written_twice(
    client: aioredis.Redis, prefix: str
) -> None:
    store = RedisFeatureStore(client, prefix)
    staged = await store.begin_load("v", FEATURES, "test")
    first = np.array([[1, 1], [2, 2]], np.float32)
    assert await staged.add(["a", "b"], first, np.ones(2, np.int64)) == []
    assert await staged.add(
        ["c", "a", "c"], np.zeros((3, 2), np.float32), np.ones(3, np.int64)
    ) == [1, 2]
    await staged.commit()
    _, rows = await store.read("v", ["a"])
    assert rows is not None and rows.values.tolist() == [[1.0, 1.0]]


async def test_writes_into_the_current_version_wait_for_no_load_and_follow_a_swap(
    client: aioredis.Redis, prefix: str
) -> None:
    store = RedisFeatureStore(client, prefix)
    await load(store, 1, 1.0)
    version = await store.current("v")
    assert version is not None
    row = pack_rows(np.full((1, 2), 4.0, np.float32), np.ones(1, np.int64))
    staged = await store.begin_load("v", FEATURES, "test")
    with pytest.raises(LoadInProgress):
        await store.write_current(version, ["e-0"], row)
    await staged.abort()
    assert await store.write_current(version, ["e-0"], row) == 1
    await load(store, 1, 2.0)
    with pytest.raises(VersionMoved):  # written into a version no longer current: refused
        await store.write_current(version, ["e-0"], row)
    _, rows = await store.read("v", ["e-0"])
    assert rows is not None and rows.values.tolist() == [[2.0, 2.0]]
