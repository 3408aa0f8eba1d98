"""What a fresh mesh is seeded with before its model servers start: seed steps.

A seed step is an async function of the resolved spec and a channel to the registry; the
launcher runs `seed_demo` and then each step a caller added (the drills add their defective
canary builds), in order, when the spec's demo is enabled.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import grpc

from servemesh.contract.control_credential import control_metadata_for
from servemesh.contract.demo import DEMO_FEATURES, demo_features, source_artifact
from servemesh.contract.errors import ServemeshError
from servemesh.spec import MeshSpec, ResolvedSpec

SeedStep = Callable[[ResolvedSpec, grpc.aio.Channel], Awaitable[None]]


class SeedConflict(ServemeshError):
    """The registry already holds a version of that name with other bytes."""


async def push_seed_version(
    spec: MeshSpec,
    registry: grpc.aio.Channel,
    *,
    model: str,
    version: str,
    data: bytes,
    signature: dict[str, list[dict[str, object]]],
    source: str,
    format: str = "torchscript",
) -> None:
    """Push one seeded version. The same bytes already there are success (a re-run of
    `servemesh up` on the same state dir); other bytes are a one-line SeedConflict that
    says how to fix it, never a traceback."""
    from servemesh.registry.client import push_version

    try:
        await push_version(
            registry,
            model=model,
            version=version,
            data=data,
            inputs=signature["inputs"],
            outputs=signature["outputs"],
            credential=control_metadata_for(spec.state_dir),
            labels={"source": source},
            format=format,
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
        raise SeedConflict(
            f"cannot seed {model}/{version} from {source!r}: {exc.details()}. Start with a "
            f"fresh state dir (remove {spec.state_dir}) or give the version another name"
        ) from None


async def seed_demo(spec: ResolvedSpec, registry: grpc.aio.Channel) -> None:
    """Push the demo model versions to the registry and demo features to Redis."""
    from servemesh.contract.demo import demo_signature

    for model_name, model in spec.models.items():
        for version, version_spec in model.versions.items():
            artifact = source_artifact(version_spec.source)
            if artifact is None:
                continue
            await push_seed_version(
                spec,
                registry,
                model=model_name,
                version=version,
                data=artifact.data,
                format=artifact.format,
                signature=demo_signature(len(model.features)),
                source=version_spec.source,
            )
    views = [name for name, v in spec.feature_views.items() if v.features == DEMO_FEATURES]
    if not views or not spec.demo.entities:
        return
    await seed_demo_features(spec, views)


async def seed_demo_features(spec: ResolvedSpec, views: list[str], batch: int = 1000) -> None:
    """Load the demo rows into each view as one new version (a load, like a user's file),
    observed now: what was there before is replaced."""
    import numpy as np

    from servemesh.services.feature.store import RedisFeatureStore
    from servemesh.spec.store_clients import store_writer

    # The primary the Sentinels name, for a replicated store (a seeding after a failover
    # reaches the promoted replica, not the lost primary the spec's URL names).
    client = store_writer(spec)
    try:
        store = RedisFeatureStore(client, spec.feature_store.key_prefix)
        rows = demo_features(spec.demo.entities)
        ids = list(rows)
        values = np.stack([rows[e] for e in ids])
        event_ms = np.full(len(ids), time.time_ns() // 1_000_000, dtype=np.int64)
        for view in views:
            load = await store.begin_load(view, DEMO_FEATURES, "demo")
            try:
                for start in range(0, len(ids), batch):
                    end = start + batch
                    await load.add(ids[start:end], values[start:end], event_ms[start:end])
                await load.commit()
            finally:
                await load.abort()  # nothing to do once committed
    finally:
        await client.aclose()
