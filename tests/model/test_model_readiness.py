"""A built model server's health follows the versions the spec routes traffic to.

The default spec routes fraud v1 (weight 100) and gives v2 no weight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.demo import Artifact
from servemesh.services.model.app import SERVICE_NAME, build_server
from servemesh.services.model.loader import LoadedModel
from servemesh.services.model.readiness import ModelServer, routed_versions
from servemesh.spec import MeshSpec, ModelSpec, Ports, ResolvedSpec, resolve
from servemesh.spec.policy import ShadowSpec
from servemesh_api.inference import grpc_service_pb2 as oip
from tests.control_kit import accept_test_credential, credentialed_channel
from tests.model.model_helpers import Stub, rows
from tests.model.test_model_server import demo_loader, infer_request
from tests.waiting import wait_until_async

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _spec() -> ResolvedSpec:
    return resolve(MeshSpec(ports=Ports.free()))


class HeldLoader:
    """The demo loader, but once `hold()` is called the next load waits for `release()`."""

    def __init__(self, artifacts: dict[int, Artifact]) -> None:
        self._load = demo_loader(artifacts)
        self._gate: asyncio.Event | None = None
        self.waiting = asyncio.Event()

    def hold(self) -> None:
        self._gate = asyncio.Event()

    def release(self) -> None:
        assert self._gate is not None
        self._gate.set()

    async def __call__(self, model: str, version: str) -> LoadedModel:
        if self._gate is not None:
            self.waiting.set()
            await self._gate.wait()
        return await self._load(model, version)


@pytest.fixture
async def replica(
    artifacts: dict[int, Artifact],
) -> AsyncIterator[tuple[ModelServer, HeldLoader, grpc.aio.Channel]]:
    loader = HeldLoader(artifacts)
    server = await build_server(_spec(), "model-fraud-zone-a-0", loader=loader, tls=False)
    assert isinstance(server, ModelServer)
    accept_test_credential(server)
    await server.start()
    channel = credentialed_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, loader, channel
    finally:
        await channel.close()
        await server.drain()


async def _status(channel: grpc.aio.Channel) -> tuple[int, int]:
    """(overall, OIP service) health as a caller (Envoy) sees it."""
    health = health_pb2_grpc.HealthStub(channel)
    overall = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    oip_service = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    return overall.status, oip_service.status


def _version(version: str) -> dict[str, oip.ModelRepositoryParameter]:
    return {"version": oip.ModelRepositoryParameter(string_param=version)}


async def _unload(stub: Stub, version: str) -> None:
    await stub.RepositoryModelUnload(
        oip.RepositoryModelUnloadRequest(model_name="fraud", parameters=_version(version)),
        timeout=10,
    )


async def _load(stub: Stub, version: str) -> None:
    await stub.RepositoryModelLoad(
        oip.RepositoryModelLoadRequest(model_name="fraud", parameters=_version(version)),
        timeout=60,
    )


def test_routed_versions_are_weighted_ones_and_shadow_targets() -> None:
    spec = MeshSpec(
        models={
            "fraud": ModelSpec(traffic={"v1": 100, "v2": 0}),
            "churn": ModelSpec(traffic={"v1": 0, "v2": 100}, shadow=ShadowSpec(version="v1")),
        }
    )
    assert routed_versions(spec) == {("fraud", "v1"), ("churn", "v2"), ("churn", "v1")}


async def test_unloading_the_routed_version_turns_not_serving_and_loading_it_back_serving(
    replica: tuple[ModelServer, HeldLoader, grpc.aio.Channel], caplog: pytest.LogCaptureFixture
) -> None:
    server, _, channel = replica
    stub = Stub(channel)
    assert await _status(channel) == (SERVING, SERVING)
    caplog.set_level(logging.INFO, logger="servemesh.services.model.readiness")
    await _unload(stub, "v1")
    assert await _status(channel) == (NOT_SERVING, NOT_SERVING)
    # OIP's ServerReady tells the same story as gRPC health.
    assert not (await stub.ServerReady(oip.ServerReadyRequest(), timeout=5)).ready
    [line] = [r for r in caplog.records if r.name == "servemesh.services.model.readiness"]
    assert line.getMessage() == "not ready: routed versions missing"
    assert vars(line)["missing"] == ["fraud:v1"]
    await _load(stub, "v1")
    assert await _status(channel) == (SERVING, SERVING)
    assert (await stub.ServerReady(oip.ServerReadyRequest(), timeout=5)).ready
    assert server.missing() == []
    reply = await stub.ModelInfer(infer_request(rows(1), version="v1"), timeout=5)
    assert reply.model_version == "v1"
    assert [r.getMessage() for r in caplog.records if r.name == line.name][1:] == [
        "ready: every routed version is loaded"
    ]


async def test_unloading_a_version_without_weight_keeps_serving(
    replica: tuple[ModelServer, HeldLoader, grpc.aio.Channel],
) -> None:
    _, _, channel = replica
    await _unload(Stub(channel), "v2")
    assert await _status(channel) == (SERVING, SERVING)


async def test_a_load_finishing_during_a_drain_does_not_turn_serving(
    replica: tuple[ModelServer, HeldLoader, grpc.aio.Channel],
) -> None:
    server, loader, channel = replica
    stub = Stub(channel)
    await _unload(stub, "v1")
    loader.hold()
    loading = asyncio.create_task(_load(stub, "v1"))
    await asyncio.wait_for(loader.waiting.wait(), timeout=30)
    draining = asyncio.create_task(server.drain())  # waits for the load in flight
    await wait_until_async(lambda: server.draining, "the drain to begin")
    loader.release()
    await loading  # the load itself succeeds ...
    await draining
    assert server.missing() == []
    # ... but the replica stays NOT_SERVING (the server no longer answers; ask its servicer).
    for service in ("", SERVICE_NAME):
        request = health_pb2.HealthCheckRequest(service=service)
        answer = await server.health.Check(request, None)
        assert answer.status == NOT_SERVING
