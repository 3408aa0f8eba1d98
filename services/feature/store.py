"""The Redis online store: one hash per entity, fields are feature names, read pipelined."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from redis.typing import EncodableT


def entity_key(prefix: str, view: str, entity_id: str) -> str:
    return f"{prefix}:{view}:{entity_id}"


class RedisFeatureStore:
    """Reads and writes feature vectors; every bulk call is one pipelined round trip."""

    def __init__(self, client: aioredis.Redis, key_prefix: str = "fs") -> None:
        self.client = client
        self.key_prefix = key_prefix

    async def read(
        self, view: str, entity_ids: Sequence[str], feature_names: Sequence[str]
    ) -> list[list[float | None]]:
        """Per entity, the values in feature_names order; None where the store has none."""
        async with self.client.pipeline(transaction=False) as pipe:
            for entity_id in entity_ids:
                pipe.hmget(entity_key(self.key_prefix, view, entity_id), list(feature_names))
            replies = await pipe.execute()
        return [[None if v is None else float(v) for v in reply] for reply in replies]

    async def write(self, view: str, entities: Mapping[str, Mapping[str, float]]) -> int:
        """Upsert every entity's values; returns how many entities were written."""
        if not entities:
            return 0
        async with self.client.pipeline(transaction=False) as pipe:
            for entity_id, values in entities.items():
                # repr of a Python float round-trips exactly, float32 values included.
                mapping: dict[EncodableT, EncodableT] = {
                    name: repr(float(value)) for name, value in values.items()
                }
                pipe.hset(entity_key(self.key_prefix, view, entity_id), mapping=mapping)
            await pipe.execute()
        return len(entities)
