"""The read path's pipelined MGETs against a real Redis: many reads in flight on one
connection each get their own reply, a caller that gives up shifts nobody's reply, an
outage fails the reads (ConnectionError, which the service answers UNAVAILABLE) and the
first read after it connects again."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from servemesh.procs import RedisServer, Supervisor
from servemesh.services.feature.pipelined import PipelinedReads
from servemesh.services.feature.store import RedisFeatureStore
from tests.feature.test_store import load


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis for this test alone (stopping it must not touch the session's)."""
    with Supervisor(tmp_path / "logs") as supervisor:
        server = RedisServer(supervisor, tmp_path / "redis")
        server.start(timeout_s=15)
        yield server


@pytest.fixture
async def seeded(redis_url: str) -> AsyncIterator[tuple[str, list[str]]]:
    """The session's Redis with 200 keys whose values name them: its URL, the keys."""
    client = aioredis.Redis.from_url(redis_url)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    keys = [f"{prefix}:k{i}" for i in range(200)]
    await client.mset({k: f"value of {k}" for k in keys})
    yield redis_url, keys
    await client.aclose()


async def test_concurrent_reads_on_one_connection_each_get_their_own_values(
    seeded: tuple[str, list[str]],
) -> None:
    url, keys = seeded
    reads = PipelinedReads.for_url(url)
    assert reads is not None

    async def read(i: int) -> None:
        wanted = [keys[i], f"{keys[i]}:absent", keys[(i * 7) % len(keys)]]
        assert await reads.mget(wanted) == [
            f"value of {keys[i]}".encode(),
            None,
            f"value of {keys[(i * 7) % len(keys)]}".encode(),
        ]

    await asyncio.gather(*(read(i) for i in range(len(keys))))
    await reads.aclose()


async def test_a_read_whose_caller_gave_up_shifts_no_other_reply(
    seeded: tuple[str, list[str]],
) -> None:
    url, keys = seeded
    reads = PipelinedReads.for_url(url)
    assert reads is not None
    await reads.mget(keys[:1])  # connected
    tasks = [asyncio.create_task(reads.mget([k])) for k in keys[:30]]
    await asyncio.sleep(0)  # every read has queued its MGET
    for task in tasks[::3]:
        task.cancel()
    answers = await asyncio.gather(*tasks, return_exceptions=True)
    for i, answer in enumerate(answers):
        if i % 3 == 0:
            assert isinstance(answer, asyncio.CancelledError)
        else:
            assert answer == [f"value of {keys[i]}".encode()]
    # The dropped replies were read off the connection: the next read gets its own.
    assert await reads.mget([keys[-1]]) == [f"value of {keys[-1]}".encode()]
    await reads.aclose()


async def test_an_outage_fails_the_reads_and_the_next_read_after_it_connects_again(
    own_redis: RedisServer,
) -> None:
    admin = aioredis.Redis.from_url(own_redis.url, password=own_redis.password)
    await admin.set("k", "v")
    reads = PipelinedReads.for_url(own_redis.url, own_redis.password)
    assert reads is not None
    assert await reads.mget(["k"]) == [b"v"]
    await asyncio.to_thread(own_redis.outage)  # snapshot, then SIGKILL by PID
    for _ in range(2):  # refused at once each time, not hung
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(reads.mget(["k"]), 5)
    await asyncio.to_thread(own_redis.start, 15)
    assert await reads.mget(["k"]) == [b"v"]
    await reads.aclose()
    await admin.aclose()


async def test_a_wrong_password_is_an_authentication_error(own_redis: RedisServer) -> None:
    reads = PipelinedReads.for_url(own_redis.url, "not-the-password")
    assert reads is not None
    with pytest.raises(redis.exceptions.AuthenticationError):
        await reads.mget(["k"])
    await reads.aclose()


async def test_a_redis_error_reply_is_a_response_error_and_the_connection_stays(
    seeded: tuple[str, list[str]],
) -> None:
    url, keys = seeded
    reads = PipelinedReads.for_url(url)
    assert reads is not None
    with pytest.raises(redis.exceptions.ResponseError):
        await reads.mget([])  # MGET without keys: Redis answers an error
    assert await reads.mget(keys[:1]) == [f"value of {keys[0]}".encode()]
    await reads.aclose()


def test_urls_it_does_not_speak_are_left_to_redis_py() -> None:
    assert PipelinedReads.for_url("rediss://:pw@127.0.0.1:6380/0") is None
    assert PipelinedReads.for_url("unix:///run/redis.sock?db=0") is None
    reads = PipelinedReads.for_url("redis://:from-url@10.0.0.1:6390/3", "given")
    assert reads is not None
    assert (reads.host, reads.port, reads.db, reads.password) == ("10.0.0.1", 6390, 3, "given")


async def test_the_store_reads_through_it_in_one_mget(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    reads = PipelinedReads.for_url(redis_url)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    store = RedisFeatureStore(client, prefix, reads=reads)
    await load(store, 4, 2.5)
    await store.read("v", ["e-0"])  # caches the version
    before = {k: v["calls"] for k, v in (await client.info("commandstats")).items()}
    version, rows = await store.read("v", ["e-3", "nobody", "e-1"])
    after = {k: v["calls"] for k, v in (await client.info("commandstats")).items()}
    assert version is not None and rows is not None
    assert rows.present.tolist() == [True, False, True]
    assert rows.values[[0, 2]].tolist() == [[2.5, 2.5], [2.5, 2.5]]
    assert after["cmdstat_mget"] - before["cmdstat_mget"] == 1
    assert after.get("cmdstat_get") == before.get("cmdstat_get")
    assert reads is not None
    await reads.aclose()
    await client.aclose()
