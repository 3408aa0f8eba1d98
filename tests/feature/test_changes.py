"""The feature replica's change feed against a real Redis publishing keyspace events: a
watcher is told it is ready once a ping came back, then hears rows written into the view's
current version, the view's pointer moving and a model's flush, in order, and not rows
staged for a version readers do not see."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from servemesh.services.feature.changes import ChangeHub
from servemesh_api.feature.v1 import feature_pb2


def _described(change: feature_pb2.Change) -> tuple[str, ...]:
    what = change.WhichOneof("what")
    if what == "row":
        return ("row", change.row.view, change.row.entity_id)
    return (str(what), getattr(change, str(what)))


async def _follow(redis_url: str) -> list[tuple[str, ...]]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(redis_url)
    hub = ChangeHub(client, prefix, ping_s=0.05)
    stream = hub.watch()
    try:
        first = await asyncio.wait_for(anext(stream), 10)
        assert first.ready and first.heartbeat_ms == 50
        await client.set(f"{prefix}:user:current", 1)
        await client.set(f"{prefix}:user@1:u1", b"row")
        await client.set(f"{prefix}:user@2:u2", b"staged")  # a load's version, not current
        await client.incr(f"{prefix}.tiers:fraud:flush")
        await client.set(f"{prefix}:user:load", 2)  # a lease: nothing cached hangs on it
        heard: list[tuple[str, ...]] = []
        while len(heard) < 3:
            message = await asyncio.wait_for(anext(stream), 10)
            assert not message.ready
            heard += [_described(c) for c in message.changes]
        # one more heartbeat: anything after the flush would have come by now
        message = await asyncio.wait_for(anext(stream), 10)
        heard += [_described(c) for c in message.changes]
        return heard
    finally:
        await stream.aclose()
        assert hub.watchers == 0
        await hub.close()
        await client.aclose()


def test_a_watcher_hears_current_rows_views_and_flushes_in_order(redis_url: str) -> None:
    assert asyncio.run(_follow(redis_url)) == [
        ("view", "user"),
        ("row", "user", "u1"),
        ("model", "fraud"),
    ]
