"""Streams against the session's real Redis, scored in process by the demo model: no mesh.

The demo model runs in the test's own process here (it is servemesh's own code, built in
the test); a consumer of a running mesh scores in a sandboxed child instead
(InProcessPredictor.from_registry, tests/streams/test_mesh_streams.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from servemesh.contract.demo import DEMO_FEATURES, build_fraud_model
from servemesh.seeding import seed_demo_features
from servemesh.services.feature.store import RedisFeatureStore
from servemesh.services.model.runner import ModelRunner
from servemesh.spec import (
    DemoSpec,
    FeatureStoreSpec,
    MeshSpec,
    Ports,
    Replicas,
    ResolvedSpec,
    StreamSpec,
    resolve,
)
from servemesh.streams.consumer import Consumer, Hook
from servemesh.streams.keys import StreamKeys
from servemesh.streams.metrics import StreamMetrics
from servemesh.streams.predict import FeatureWriter, InProcessPredictor, Predictor

ENTITIES = 50


def stream_spec(redis_url: str, state_dir: Path, **stream: Any) -> ResolvedSpec:
    """A one-zone mesh (never started) whose Redis is the session's, with one stream."""
    name = stream.pop("name", f"s{uuid.uuid4().hex[:8]}")
    return resolve(
        MeshSpec(
            zones=["zone-a"],
            ports=Ports.free(),
            state_dir=str(state_dir),
            gateway=Replicas(per_zone={"zone-a": 1}),
            feature=Replicas(per_zone={"zone-a": 1}),
            model_servers=Replicas(per_zone={"zone-a": 1}),
            feature_store=FeatureStoreSpec(
                redis_url=redis_url, key_prefix=f"t{uuid.uuid4().hex[:8]}"
            ),
            demo=DemoSpec(entities=ENTITIES),
            streams=[StreamSpec(name=name, model="fraud", mode="in_process", **stream)],
        )
    )


@dataclass
class StreamKit:
    spec: ResolvedSpec
    redis: aioredis.Redis
    runner: ModelRunner
    clients: list[aioredis.Redis] = field(default_factory=list)

    def client(self) -> aioredis.Redis:
        client = aioredis.Redis.from_url(self.spec.redis_url)
        self.clients.append(client)
        return client

    async def close(self) -> None:
        for client in [*self.clients, self.redis]:
            await client.aclose()

    @property
    def stream(self) -> StreamSpec:
        return self.spec.streams[0]

    @property
    def keys(self) -> StreamKeys:
        return StreamKeys.of(self.stream)

    def score(self, matrices: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        (rows,) = matrices.values()  # the demo model's one input
        return {"score": np.asarray(self.runner.run(rows))}

    def predictor(self) -> InProcessPredictor:
        store = RedisFeatureStore(self.client(), self.spec.feature_store.key_prefix)
        return InProcessPredictor(
            self.spec,
            self.stream,
            store,
            self.score,
            version="v1",
            input_names=["features"],
            output_names=["score"],
        )

    def consumer(
        self,
        *,
        name: str | None = None,
        predictor: Predictor | None = None,
        after_write: Hook | None = None,
        metrics: StreamMetrics | None = None,
    ) -> Consumer:
        store = RedisFeatureStore(self.client(), self.spec.feature_store.key_prefix)
        return Consumer(
            self.client(),
            self.spec,
            self.stream,
            predictor or self.predictor(),
            writer=FeatureWriter(store, self.spec, self.stream.model),
            consumer=name,
            after_write=after_write,
            metrics=metrics,
        )

    async def send(self, n: int, **fields: str) -> list[str]:
        """n events for user-0.. (round robin), or with the given fields; their ids."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in range(n):
                event: dict[Any, Any] = dict(fields) or {"entity": f"user-{i % ENTITIES}"}
                pipe.xadd(self.keys.input, event)
            ids = await pipe.execute()
        return [i.decode() for i in ids]

    async def outputs(self) -> list[tuple[str, dict[str, str]]]:
        entries: Any = await self.redis.xrange(self.keys.output)
        return [(i.decode(), {k.decode(): v.decode() for k, v in f.items()}) for i, f in entries]

    async def dead(self) -> list[dict[str, str]]:
        entries: Any = await self.redis.xrange(self.keys.dead_letter)
        return [{k.decode(): v.decode() for k, v in f.items()} for _, f in entries]

    def expected_score(self, row: np.ndarray) -> float:
        result: Any = self.runner.run(row.reshape(1, -1).astype(np.float32))
        return float(result[0][0])


async def make_kit(redis_url: str, state_dir: Path, **stream: Any) -> StreamKit:
    spec = stream_spec(redis_url, state_dir, **stream)
    await seed_demo_features(spec, ["user"])
    module = build_fraud_model(1)
    runner = ModelRunner(
        module, model="fraud", version="v1", row_shape=(len(DEMO_FEATURES),), num_threads=1
    )
    return StreamKit(spec=spec, redis=aioredis.Redis.from_url(redis_url), runner=runner)


async def drain(consumer: Consumer, until: Callable[[], Awaitable[bool]], limit: int = 500) -> None:
    """Run the consumer's steps until `until()` holds (bounded: `limit` steps)."""
    await consumer.ensure_group()
    for _ in range(limit):
        if await until():
            return
        await consumer.step()
    raise AssertionError(f"not done after {limit} steps")


async def run_until(
    consumer: Consumer, until: Callable[[], Awaitable[bool]], timeout_s: float = 60
) -> None:
    """Run the consumer's own loop until `until()` holds, then stop it (as SIGTERM does)."""
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        async with asyncio.timeout(timeout_s):
            while not await until():
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await task
