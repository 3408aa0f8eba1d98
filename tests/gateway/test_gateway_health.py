"""A gateway is SERVING only while it can answer: its rule, then a real gateway whose
feature service (over a real Redis), model replica and mesh listener go down and return."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from servemesh.contract.atomic import atomic_write_text
from servemesh.identity import dial_service, serving_credentials
from servemesh.procs import RedisServer, Supervisor
from servemesh.services.feature.app import build_server as build_feature
from servemesh.services.gateway.app import build_server as build_gateway
from servemesh.services.gateway.health import Needs, Seen, judge, needs_of
from servemesh.services.runtime import ServiceServer
from servemesh.services.runtime.live_spec import LiveSpec
from servemesh.spec import (
    FeatureStoreSpec,
    MeshSpec,
    ModelSpec,
    Ports,
    Replicas,
    ResolvedSpec,
    dump_spec,
    free_port,
    resolve,
)
from tests.feature.test_feature_health import NOT_SERVING, SERVING, health_becomes

GATEWAY = "gateway-zone-a-0"
FEATURE = "feature-zone-a-0"
MODEL = "model-fraud-zone-a-0"

ALL_UP = Seen(mesh_listener=True, feature_serving=2, feature_total=2, model_serving=1,
              model_total=2)  # fmt: skip


def one_zone(
    redis_url: str,
    state_dir: Path,
    models: dict[str, ModelSpec],
    password_file: Path | None = None,
) -> MeshSpec:
    one = Replicas(per_zone={"zone-a": 1})
    return MeshSpec(
        zones=["zone-a"],
        ports=Ports.free(),
        state_dir=str(state_dir),
        gateway=one,
        feature=one,
        model_servers=one,
        models=models,
        feature_store=FeatureStoreSpec(
            redis_url=redis_url, password_file=str(password_file) if password_file else None
        ),
    )


# --- the rule ------------------------------------------------------------------------------


def test_only_models_without_a_fallback_need_their_dependencies() -> None:
    spec = one_zone(
        "redis://127.0.0.1:1/0",
        Path("."),
        {"fraud": ModelSpec(), "safe": ModelSpec(fallback_score=0.5)},
    )
    assert needs_of(spec) == Needs(features=("fraud",), models=("fraud",))
    covered = spec.model_copy(update={"models": {"safe": ModelSpec(fallback_score=0.1)}})
    assert needs_of(covered) == Needs(features=(), models=())


def test_a_gateway_that_can_answer_is_up() -> None:
    needs = Needs(features=("fraud",), models=("fraud",))
    assert judge(needs, ALL_UP).ok
    one_feature_left = Seen(True, 1, 2, 1, 2)
    assert judge(needs, one_feature_left).ok


def test_no_mesh_listener_no_answers_even_with_fallbacks() -> None:
    verdict = judge(Needs((), ()), Seen(False, 2, 2, 2, 2), "127.0.0.1:9000")
    assert not verdict.ok and "127.0.0.1:9000" in verdict.reason


def test_no_feature_replica_takes_it_down_only_for_a_model_without_fallback() -> None:
    no_features = Seen(True, 0, 2, 2, 2)
    verdict = judge(Needs(features=("fraud",), models=("fraud",)), no_features)
    assert not verdict.ok and "feature" in verdict.reason and "fraud" in verdict.reason
    assert judge(Needs(features=(), models=("raw-only",)), no_features).ok


def test_no_model_replica_takes_it_down_only_for_a_model_without_fallback() -> None:
    no_models = Seen(True, 2, 2, 0, 2)
    verdict = judge(Needs(features=(), models=("fraud",)), no_models)
    assert not verdict.ok and "model replica" in verdict.reason
    assert judge(Needs((), ()), no_models).ok


# --- a real gateway ------------------------------------------------------------------------


@dataclass
class Dependencies:
    """A gateway's world: its spec file, Redis, a feature service, a model replica's health
    service, and a TCP listener on the zone's mesh port standing in for Envoy's."""

    spec: ResolvedSpec
    spec_path: Path
    redis: RedisServer
    model: ServiceServer
    gateway: grpc.aio.Channel
    listener: asyncio.Server | None = None

    async def open_listener(self) -> None:
        async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        port = self.spec.mesh_ports["zone-a"]
        self.listener = await asyncio.start_server(hang_up, self.spec.host, port)

    async def close_listener(self) -> None:
        assert self.listener is not None
        self.listener.close()
        await self.listener.wait_closed()
        self.listener = None

    def apply(self, models: dict[str, ModelSpec]) -> None:
        """Change the running spec's models the way `servemesh apply` does: atomically, a
        new model's own pool with ports of its own."""
        changed = resolve(self.spec.model_copy(update={"models": models}))
        atomic_write_text(self.spec_path, dump_spec(changed))


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with Supervisor(tmp_path / "logs") as supervisor:
        server = RedisServer(supervisor, tmp_path / "redis")
        server.start(timeout_s=15)
        yield server


@pytest.fixture
async def deps(own_redis: RedisServer, tmp_path: Path) -> AsyncIterator[Dependencies]:
    spec = resolve(
        one_zone(own_redis.url, tmp_path, {"fraud": ModelSpec()}, own_redis.password_path)
    )
    spec_path = tmp_path / "mesh.resolved.yaml"
    atomic_write_text(spec_path, dump_spec(spec))
    feature = await build_feature(spec, FEATURE)
    await feature.start()
    model = ServiceServer(
        MODEL,
        host=spec.host,
        port=spec.port_of(MODEL),
        credentials=serving_credentials(spec, MODEL),
    )
    await model.start()
    gateway = await build_gateway(spec, GATEWAY)
    gateway.follow_spec(LiveSpec(spec_path, spec))
    await gateway.start()
    channel = dial_service(spec, GATEWAY).aio_channel()
    world = Dependencies(spec, spec_path, own_redis, model, channel)
    await world.open_listener()
    yield world
    await channel.close()
    for server in (gateway, feature, world.model):  # a test may have replaced the model
        await server.drain()
    if world.listener is not None:
        await world.close_listener()


async def test_gateway_is_down_while_a_dependency_is_and_back_when_it_returns(
    deps: Dependencies,
) -> None:
    await health_becomes(deps.gateway, SERVING)

    # The feature store dies: the feature replica goes NOT_SERVING, and so does the gateway
    # (fraud reads features and has no fallback).
    await asyncio.to_thread(deps.redis.outage)
    await health_becomes(deps.gateway, NOT_SERVING)
    await asyncio.to_thread(deps.redis.start, 15)
    await health_becomes(deps.gateway, SERVING)

    # The only model replica is not ready.
    await deps.model.set_serving(False)
    await health_becomes(deps.gateway, NOT_SERVING)
    await deps.model.set_serving(True)
    await health_becomes(deps.gateway, SERVING)

    # The zone's mesh listener stops accepting connections, then returns on its port.
    await deps.close_listener()
    await health_becomes(deps.gateway, NOT_SERVING)
    await deps.open_listener()
    await health_becomes(deps.gateway, SERVING)


async def test_models_and_fallbacks_applied_live_change_the_rule(deps: Dependencies) -> None:
    await health_becomes(deps.gateway, SERVING)
    await asyncio.to_thread(deps.redis.outage)
    await health_becomes(deps.gateway, NOT_SERVING)

    # A fallback makes fraud answerable without features: the gateway serves degraded.
    deps.apply({"fraud": ModelSpec(fallback_score=0.5)})
    await health_becomes(deps.gateway, SERVING)

    # A model added live without a fallback needs the (still dead) features again.
    deps.apply({"fraud": ModelSpec(fallback_score=0.5), "wine": ModelSpec()})
    await health_becomes(deps.gateway, NOT_SERVING)

    await asyncio.to_thread(deps.redis.start, 15)
    await health_becomes(deps.gateway, SERVING)


class Relay:
    """A TCP relay in front of a replica that can freeze: its connections stay open and no
    byte passes either way, which is how a stalled (say SIGSTOPped) process looks from
    outside. New connections are accepted, and frozen too, as the kernel would."""

    def __init__(self, host: str, port: int, target_port: int) -> None:
        self.host, self.port, self.target_port = host, port, target_port
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            await self.flowing.wait()
            writer.write(data)
            await writer.drain()
        writer.close()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        self.flowing.set()
        await self._server.wait_closed()


# 14 s of a replica stopped, then stalled, then back: the whole suite runs it, not the fast lane.
@pytest.mark.slow
async def test_a_model_replica_that_stops_or_stalls_takes_the_gateway_down_until_it_answers(
    deps: Dependencies,
) -> None:
    # How fast the gateway notices a dead dependency, whatever its probes become: a replica
    # that stops refuses them, and one that stalls lets them time out.
    await health_becomes(deps.gateway, SERVING)
    await deps.model.drain()
    await health_becomes(deps.gateway, NOT_SERVING)

    # The replica returns behind a relay on its address: the gateway reaches it again.
    spec = deps.spec
    model = ServiceServer(
        MODEL,
        host=spec.host,
        port=free_port(spec.host),
        credentials=serving_credentials(spec, MODEL),
    )
    await model.start()
    deps.model = model  # the fixture drains this one
    relay = Relay(spec.host, spec.port_of(MODEL), model.port)
    await relay.start()
    try:
        await health_becomes(deps.gateway, SERVING)
        relay.flowing.clear()  # stalled: connected, answering nothing
        await health_becomes(deps.gateway, NOT_SERVING)
        relay.flowing.set()
        await health_becomes(deps.gateway, SERVING)
    finally:
        await relay.close()
