"""Feature fixtures: feature services built in-process on loopback over the session's real
Redis, each with a key prefix of its own, and the state dir a running mesh would leave
(its resolved spec) so the CLI finds them."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis

from servemesh.contract.control_credential import control_metadata, ensure_control_token
from servemesh.contract.demo import DEMO_FEATURES
from servemesh.identity import dial_service
from servemesh.services.feature.app import build_server
from servemesh.services.runtime import ServiceServer
from servemesh.spec import (
    FeatureStoreSpec,
    FeatureViewSpec,
    Limits,
    MeshSpec,
    Ports,
    Replicas,
    ResolvedSpec,
    dump_spec,
    resolve,
)
from servemesh.state.paths import MeshPaths
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc
from tests.control_kit import credentialed_channel

INSTANCE = "feature-zone-a-0"
DAY_MS = 24 * 3600 * 1000


@dataclass
class RunningFeatures:
    """One feature service of a one-zone mesh, its spec and state dir, and Redis."""

    spec: ResolvedSpec
    stub: feature_pb2_grpc.FeatureServiceStub
    redis: aioredis.Redis
    state_dir: Path

    @property
    def prefix(self) -> str:
        return self.spec.feature_store.key_prefix

    async def keys(self) -> set[str]:
        """Every Redis key under this service's prefix."""
        return {k.decode() async for k in self.redis.scan_iter(match=f"{self.prefix}:*")}

    async def cli(self, *args: str) -> tuple[int, str, str]:
        """Run `python -m servemesh ARGS --state-dir <this mesh>`: exit code, stdout, stderr."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "servemesh",
            *args,
            "--state-dir",
            str(self.state_dir),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()


def features_spec(
    redis_url: str,
    state_dir: Path,
    views: Mapping[str, FeatureViewSpec],
    missing: Literal["error", "defaults"] = "error",
    max_message_bytes: int = 4 * 1024 * 1024,
    password_file: Path | None = None,
    limits: Limits | None = None,
) -> ResolvedSpec:
    """A one-zone mesh whose feature store has `views` (and the demo's user view)."""
    return resolve(
        MeshSpec(
            zones=["zone-a"],
            ports=Ports.free(),
            state_dir=str(state_dir),
            gateway=Replicas(per_zone={"zone-a": 1}),
            feature=Replicas(per_zone={"zone-a": 1}),
            model_servers=Replicas(per_zone={"zone-a": 1}),
            feature_views={"user": FeatureViewSpec(features=list(DEMO_FEATURES)), **views},
            feature_store=FeatureStoreSpec(
                redis_url=redis_url,
                missing_entity=missing,
                default_value=-1.0,
                key_prefix=f"t{uuid.uuid4().hex[:8]}",
                password_file=str(password_file) if password_file else None,
            ),
            limits=limits or Limits(max_message_bytes=max_message_bytes),
        )
    )


StartFeatures = Callable[..., Coroutine[Any, Any, RunningFeatures]]
# What a view does with a row older than its max_age (FeatureViewSpec.staleness).
Staleness = Literal["error", "default", "degraded"]


@pytest.fixture
async def start_features(redis_url: str, tmp_path: Path) -> AsyncIterator[StartFeatures]:
    """Start feature services: `await start_features(views, missing=..., ...)`."""
    started: list[tuple[ServiceServer, grpc.aio.Channel, aioredis.Redis]] = []

    async def start(views: Mapping[str, FeatureViewSpec], **options: Any) -> RunningFeatures:
        state_dir = tmp_path / f"state-{len(started)}"
        state_dir.mkdir()
        url = options.pop("redis_url", redis_url)  # a Redis of the test's own
        spec = features_spec(url, state_dir, views, **options)
        MeshPaths(state_dir).resolved_spec.write_text(dump_spec(spec))
        # As `servemesh up` does: the service reads it at start, the CLI when it loads.
        token = ensure_control_token(state_dir)
        # As a running mesh's: mutual TLS on its port (the CLI dials it as the operator).
        server = await build_server(spec, INSTANCE)
        await server.start()
        channel = credentialed_channel(dial_service(spec, INSTANCE), control_metadata(token))
        client = aioredis.Redis.from_url(redis_url)
        started.append((server, channel, client))
        stub = feature_pb2_grpc.FeatureServiceStub(channel)
        return RunningFeatures(spec=spec, stub=stub, redis=client, state_dir=state_dir)

    yield start
    for server, channel, client in started:
        await channel.close()
        await server.drain()
        await client.aclose()


async def load_rows(
    stub: feature_pb2_grpc.FeatureServiceStub,
    view: str,
    features: list[str],
    rows: Mapping[str, list[float]],
    event_ms: list[int] | None = None,
) -> feature_pb2.LoadFeaturesResponse:
    """Replace `view` with `rows` through LoadFeatures: a header, one chunk, the commit."""
    values = np.asarray(list(rows.values()), dtype="<f4").reshape(len(rows), len(features))

    async def messages() -> AsyncIterator[feature_pb2.LoadFeaturesRequest]:
        yield feature_pb2.LoadFeaturesRequest(
            header=feature_pb2.LoadHeader(view=view, feature_names=features, source="test")
        )
        yield feature_pb2.LoadFeaturesRequest(
            chunk=feature_pb2.LoadChunk(
                entity_ids=list(rows),
                values=values.tobytes(),
                event_times_unix_ms=event_ms or [],
            )
        )
        yield feature_pb2.LoadFeaturesRequest(commit=feature_pb2.LoadCommit(rows=len(rows)))

    return await stub.LoadFeatures(messages())


async def fresh_and_old(
    start_features: StartFeatures, policy: Staleness, max_age: str | None = "1h"
) -> tuple[feature_pb2_grpc.FeatureServiceStub, int, str]:
    """A view with `max_age` holding `old` (two days old) and `new` (now): its stub, now,
    and the service's metrics address."""
    view = FeatureViewSpec(
        features=["a", "b"], max_age=max_age, staleness=policy, defaults={"a": 9.0}
    )
    running = await start_features({"fresh": view})
    now = time.time_ns() // 1_000_000
    await load_rows(
        running.stub,
        "fresh",
        ["a", "b"],
        {"old": [1.0, 2.0], "new": [3.0, 4.0]},
        event_ms=[now - 2 * DAY_MS, now],
    )
    return running.stub, now, running.spec.metrics_address_of(INSTANCE)
