"""A feature service is SERVING only while its Redis answers: a real Redis of the test's
own, stopped by PID and started again, observed through the gRPC health service."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.wire import FEATURE_SERVICE
from servemesh.procs import RedisServer, Supervisor
from servemesh.services.feature.app import build_server
from servemesh.services.feature.health import watch_store
from servemesh.services.runtime import ServiceServer
from servemesh.services.runtime.dependencies import Debounce
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc
from tests.feature.conftest import INSTANCE, features_spec
from tests.waiting import wait_until_async

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health_becomes(
    channel: grpc.aio.Channel, status: int, service: str = "", timeout_s: float = 30.0
) -> None:
    """Wait (on the health service's Watch stream) until `service` reports `status`."""
    stub = health_pb2_grpc.HealthStub(channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    seen: list[str] = []
    try:
        async for reply in call:
            seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            if reply.status == status:
                return
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    finally:
        call.cancel()
    want = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    pytest.fail(f"{service or 'the server'} never reported {want} in {timeout_s} s; saw {seen}")


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis for this test alone (stopping it must not touch the session's)."""
    with Supervisor(tmp_path / "logs") as supervisor:
        server = RedisServer(supervisor, tmp_path / "redis")
        server.start(timeout_s=15)
        yield server


@pytest.fixture
async def feature_server(
    own_redis: RedisServer, tmp_path: Path
) -> AsyncIterator[tuple[ServiceServer, grpc.aio.Channel]]:
    # The service reads the password from the file the spec names, as in a mesh.
    spec = features_spec(own_redis.url, tmp_path, {}, password_file=own_redis.password_path)
    server = await build_server(spec, INSTANCE, tls=False)
    await server.start()
    channel = grpc.aio.insecure_channel(spec.address_of(INSTANCE))
    yield server, channel
    await channel.close()
    await server.drain()


async def test_feature_service_follows_its_redis_down_and_back(
    own_redis: RedisServer, feature_server: tuple[ServiceServer, grpc.aio.Channel]
) -> None:
    _, channel = feature_server
    await health_becomes(channel, SERVING)
    await health_becomes(channel, SERVING, FEATURE_SERVICE)

    pid = await asyncio.to_thread(own_redis.outage)  # SIGKILL by PID
    assert pid > 0 and not own_redis.is_running()
    await health_becomes(channel, NOT_SERVING)
    await health_becomes(channel, NOT_SERVING, FEATURE_SERVICE)
    # Still answering calls while out of rotation: at once, with the reason.
    stub = feature_pb2_grpc.FeatureServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.GetFeatures(
            feature_pb2.GetFeaturesRequest(view="user", entity_ids=["u"], feature_names=["amount"]),
            timeout=10,
        )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    await asyncio.to_thread(own_redis.start, 15)
    await health_becomes(channel, SERVING)
    await health_becomes(channel, SERVING, FEATURE_SERVICE)


async def test_a_feature_service_whose_redis_is_absent_starts_not_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="servemesh.services.runtime.dependencies")
    # A port nothing listens on: the replica must never say SERVING.
    with Supervisor(tmp_path / "logs") as supervisor:
        redis = RedisServer(supervisor, tmp_path / "redis")
        await asyncio.to_thread(redis.start, 15)
        url = redis.url
        await asyncio.to_thread(redis.stop)
    spec = features_spec(url, tmp_path, {})
    server = await build_server(spec, INSTANCE, tls=False)
    await server.start()
    channel = grpc.aio.insecure_channel(spec.address_of(INSTANCE))
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        # The first PING failed: the replica has judged its store, and says so.
        await wait_until_async(
            lambda: any(
                r.getMessage() == "not ready: a dependency does not answer" for r in caplog.records
            ),
            "the failed PING logged",
        )
        for service in ("", FEATURE_SERVICE):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == NOT_SERVING, service
    finally:
        await channel.close()
        await server.drain()


async def test_each_transition_is_logged_once_not_every_probe(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    server = ServiceServer("feature-under-test")
    watch = watch_store(server, own_redis.url, own_redis.password)
    await server.start()
    caplog.set_level(logging.INFO, logger="servemesh.services.runtime.dependencies")
    try:
        await wait_until_async(lambda: watch.up, "the first good PING")
        await asyncio.to_thread(own_redis.outage)
        await wait_until_async(lambda: not watch.up, "the store to be called down")
        # Several more failed rounds after the transition: still one line about it.
        failed = watch.debounce.failures
        await wait_until_async(lambda: watch.debounce.failures >= failed + 3, "more probes")
        await asyncio.to_thread(own_redis.start, 15)
        await wait_until_async(lambda: watch.up, "the store to be back")
    finally:
        await server.drain()
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("not ready: a dependency does not answer") == 1, messages
    assert messages.count("ready: dependencies answer") == 2, messages  # start, recovery


def test_one_slow_answer_does_not_take_a_replica_down() -> None:
    rule = Debounce(failures_to_fail=3)
    assert rule.observe(True) and rule.up is True
    assert not rule.observe(False) and rule.up is True
    assert not rule.observe(False) and rule.up is True
    assert not rule.observe(True) and rule.up is True  # a good round resets the count
    assert rule.failures == 0
    for _ in range(2):
        assert not rule.observe(False)
    assert rule.observe(False) and rule.up is False  # the third in a row
    assert not rule.observe(False) and rule.up is False  # no second transition
    assert rule.observe(True) and rule.up is True  # one good round brings it back


def test_before_the_first_good_round_a_failure_is_down_at_once() -> None:
    rule = Debounce(failures_to_fail=3)
    assert rule.observe(False) and rule.up is False
