"""Batch fixtures: the state dir a running mesh leaves (its resolved spec and control
token), a real registry serving it over mutual TLS with the demo model pushed, and the
session's real Redis holding a loaded feature view; no Envoy, no model servers."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis

from servemesh.contract.control_credential import control_metadata, ensure_control_token
from servemesh.contract.demo import DEMO_FEATURES, demo_artifact, demo_features, demo_signature
from servemesh.identity import dial_registry
from servemesh.registry.app import build_server
from servemesh.registry.client import push_version
from servemesh.services.feature.store import RedisFeatureStore
from servemesh.services.runtime import ServiceServer
from servemesh.spec import (
    FeatureStoreSpec,
    FeatureViewSpec,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    Replicas,
    ResolvedSpec,
    dump_spec,
    resolve,
)
from servemesh.state.paths import MeshPaths


def demo_bytes(seed: int) -> bytes:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        return demo_artifact(seed).data


@dataclass
class BatchMesh:
    """A registry and an online store, as a running mesh's state dir names them."""

    spec: ResolvedSpec
    state_dir: Path
    redis: aioredis.Redis
    registry: grpc.aio.Channel
    token: str

    @property
    def store(self) -> RedisFeatureStore:
        return RedisFeatureStore(self.redis, self.spec.feature_store.key_prefix)

    async def load_view(self, n: int, view: str = "user", seed: int = 7) -> dict[str, Any]:
        """Replace `view` with the demo rows of n entities (user-0..); the rows."""
        rows = demo_features(n, seed)
        ids = list(rows)
        values = np.stack([rows[e] for e in ids]) if ids else np.empty((0, 64), np.float32)
        now = time.time_ns() // 1_000_000
        event_ms = now - np.arange(len(ids), dtype=np.int64) * 1000
        load = await self.store.begin_load(view, DEMO_FEATURES, "test")
        try:
            for start in range(0, len(ids), 1000):
                end = start + 1000
                await load.add(ids[start:end], values[start:end], event_ms[start:end])
            await load.commit()
        finally:
            await load.abort()
        return {"ids": ids, "values": values, "event_ms": event_ms}

    async def push(self, model: str, version: str, seed: int) -> None:
        await push_version(
            self.registry,
            model=model,
            version=version,
            data=demo_bytes(seed),
            credential=control_metadata(self.token),
            **demo_signature(64),  # type: ignore[arg-type]
        )

    async def cli(self, *args: str) -> tuple[int, str, str]:
        proc = await self.start_cli(*args)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def start_cli(self, *args: str) -> asyncio.subprocess.Process:
        """`python -m servemesh ARGS --state-dir <this mesh>`, its output piped, with Ctrl-C
        (SIGINT) as a terminal's foreground command has it (DEFAULT_SIGINT)."""
        return await asyncio.create_subprocess_exec(
            *DEFAULT_SIGINT, sys.executable, "-m", "servemesh", *args,
            "--state-dir", str(self.state_dir),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip


# Put before a command: a Python that sets SIGINT to its default disposition and execs the
# command in its place (the same PID). A test run started in the background of a shell
# without job control ignores SIGINT, and every process it starts inherits that; the Ctrl-C
# tests would then see the command finish untouched (exit 0, not 130), though the command
# handles Ctrl-C as it should. Not a preexec_fn: Python code between fork and exec, in this
# process full of gRPC threads, let gRPC's fork handlers restart a poller in the child that
# the exec's closing of descriptors then broke ("epoll_wait error: Bad file descriptor",
# the child aborted before exec; seen in the batch CLI tests). servemesh/procs/spawn.py
# avoids preexec_fn for the same reason.
DEFAULT_SIGINT = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])",
)


async def get(client: aioredis.Redis, key: str) -> bytes:
    """A string key that must be there."""
    value = await client.get(key)
    assert isinstance(value, bytes), f"{key}: {value!r}"
    return value


def batch_spec(
    redis_url: str, state_dir: Path, inject_latency_ms: float = 0.0, **changes: Any
) -> ResolvedSpec:
    versions = {
        "v1": ModelVersionSpec(source="registry", inject_latency_ms=inject_latency_ms),
        "v2": ModelVersionSpec(source="registry"),
    }
    return resolve(
        MeshSpec(
            zones=["zone-a"],
            ports=Ports.free(),
            state_dir=str(state_dir),
            gateway=Replicas(per_zone={"zone-a": 1}),
            feature=Replicas(per_zone={"zone-a": 1}),
            model_servers=Replicas(per_zone={"zone-a": 1}),
            models={"fraud": ModelSpec(versions=versions, traffic={"v1": 100, "v2": 0})},
            feature_views={"user": FeatureViewSpec(features=list(DEMO_FEATURES))},
            feature_store=FeatureStoreSpec(
                redis_url=redis_url, key_prefix=f"t{uuid.uuid4().hex[:8]}"
            ),
            **changes,
        )
    )


StartBatchMesh = Callable[..., Coroutine[Any, Any, BatchMesh]]


@pytest.fixture
async def start_mesh(redis_url: str, tmp_path: Path) -> AsyncIterator[StartBatchMesh]:
    """`await start_mesh(inject_latency_ms=...)`: the registry (demo v1 = seed 1, v2 = seed
    2 pushed), the spec written where the CLI finds it."""
    started: list[tuple[ServiceServer, grpc.aio.Channel, aioredis.Redis]] = []

    async def start(**options: Any) -> BatchMesh:
        state_dir = tmp_path / f"state-{len(started)}"
        state_dir.mkdir()
        spec = batch_spec(redis_url, state_dir, **options)
        MeshPaths(state_dir).resolved_spec.write_text(dump_spec(spec))
        token = ensure_control_token(state_dir)
        server = await build_server(spec, spec.registry_instance)
        await server.start()
        channel = dial_registry(spec).aio_channel()
        client = aioredis.Redis.from_url(redis_url)
        started.append((server, channel, client))
        mesh = BatchMesh(spec, state_dir, client, channel, token)
        await mesh.push("fraud", "v1", 1)
        await mesh.push("fraud", "v2", 2)
        return mesh

    yield start
    for server, channel, client in started:
        await channel.close()
        await server.drain()
        await client.aclose()
