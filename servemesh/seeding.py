"""What a fresh mesh is seeded with before its model servers start: seed steps.

A seed step is an async function of the resolved spec and a channel to the registry; the
launcher runs `seed_demo` and then each step a caller added (the drills add their defective
canary builds), in order, when the spec's demo is enabled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from servemesh.demo import DEMO_FEATURES, demo_seed
from servemesh.spec import MeshSpec

SeedStep = Callable[[MeshSpec, grpc.aio.Channel], Awaitable[None]]


async def seed_demo(spec: MeshSpec, registry: grpc.aio.Channel) -> None:
    """Push the demo model versions to the registry and demo features to Redis."""
    from servemesh.demo import demo_artifact, demo_features, demo_signature
    from servemesh.registry.client import push_version
    from servemesh.services.feature.store import RedisFeatureStore

    for model_name, model in spec.models.items():
        for version, version_spec in model.versions.items():
            seed = demo_seed(version_spec.source)
            if seed is None:
                continue
            artifact = demo_artifact(seed)
            signature = demo_signature(len(model.features))
            await push_version(
                registry,
                model=model_name,
                version=version,
                data=artifact.data,
                inputs=signature["inputs"],
                outputs=signature["outputs"],
                labels={"source": version_spec.source},
            )
    views = {m.feature_view for m in spec.models.values() if m.features == DEMO_FEATURES}
    if not views or not spec.demo.entities:
        return
    import redis.asyncio as aioredis

    assert spec.feature_store.redis_url, "the launcher sets the Redis URL before seeding"
    client = aioredis.Redis.from_url(spec.feature_store.redis_url)
    try:
        store = RedisFeatureStore(client, spec.feature_store.key_prefix)
        rows = demo_features(spec.demo.entities)
        batch: dict[str, dict[str, float]] = {}
        for entity_id, row in rows.items():
            batch[entity_id] = dict(zip(DEMO_FEATURES, row.tolist(), strict=True))
            if len(batch) == 1000:
                for view in views:
                    await store.write(view, batch)
                batch = {}
        for view in views:
            await store.write(view, batch)
    finally:
        await client.aclose()
