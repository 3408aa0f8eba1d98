"""A model replica follows the live spec: per-version health, loads and unloads, readiness.

The replica is a built model server (`build_server`) on a real port, loading the demo
artifacts; the spec file it follows is a real file the test rewrites (as `servemesh apply`
does), read back through LiveSpec.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.demo import Artifact
from servemesh.contract.wire import (
    LOAD_CONFIG_PARAMETER,
    LOAD_VERSION_PARAMETER,
    version_health_name,
)
from servemesh.services.model.app import build_server
from servemesh.services.model.load_specs import LoadSpecs
from servemesh.services.model.loader import registry_loader
from servemesh.services.model.readiness import ModelServer
from servemesh.services.runtime.live_spec import LiveSpec
from servemesh.spec import (
    BatchingSpec,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    ResolvedSpec,
    dump_spec,
    resolve,
)
from servemesh_api.inference import grpc_service_pb2 as oip
from tests.control_kit import accept_test_credential, credentialed_channel
from tests.model.model_helpers import Stub
from tests.model.test_model_loader import CHANNEL, FakeRegistry, record
from tests.model.test_model_readiness import HeldLoader

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REPLICA = "model-fraud-zone-a-0"


def _spec(
    traffic: dict[str, int] | None = None, versions: tuple[str, ...] = ("v1", "v2")
) -> ResolvedSpec:
    model = ModelSpec(
        versions={v: ModelVersionSpec(source=f"demo:{v[1:]}") for v in versions},
        traffic=traffic or {versions[0]: 100},
    )
    ports = Ports.free()
    return resolve(MeshSpec(ports=ports, models={"fraud": model}))


class Replica:
    def __init__(self, server: ModelServer, loader: HeldLoader, path: Path, live: LiveSpec) -> None:
        self.server, self.loader, self.path, self.live = server, loader, path, live
        self.channel = credentialed_channel(f"127.0.0.1:{server.port}")
        self.stub = Stub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def status(self, service: str = "") -> int:
        answer = await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(answer.status)

    async def version_status(self, version: str) -> int:
        return await self.status(version_health_name("fraud", version))

    async def change_spec(self, traffic: dict[str, int], versions: tuple[str, ...]) -> None:
        """Rewrite the followed file (keeping the ports) and let the replica take it."""
        new = self.live.current.model_copy(update={"models": _spec(traffic, versions).models})
        atomic_write_text(self.path, dump_spec(new))
        assert await self.live.refresh()


@pytest.fixture
async def replica(artifacts: dict[int, Artifact], tmp_path: Path) -> AsyncIterator[Replica]:
    spec = _spec()
    path = tmp_path / "mesh.resolved.yaml"
    atomic_write_text(path, dump_spec(spec))
    loader = HeldLoader(artifacts)
    server = await build_server(spec, REPLICA, loader=loader, tls=False)
    assert isinstance(server, ModelServer)
    accept_test_credential(server)
    # What service_main does: follow the file; the test refreshes instead of polling.
    live = LiveSpec(path, spec, interval_s=3600)
    server.follow_spec(live)
    await server.start()
    found = Replica(server, loader, path, live)
    try:
        yield found
    finally:
        await found.channel.close()
        await server.drain()


async def test_each_version_reports_its_own_health(replica: Replica) -> None:
    assert await replica.version_status("v1") == SERVING
    assert await replica.version_status("v2") == SERVING
    await replica.stub.RepositoryModelUnload(
        oip.RepositoryModelUnloadRequest(
            model_name="fraud",
            parameters={LOAD_VERSION_PARAMETER: oip.ModelRepositoryParameter(string_param="v2")},
        ),
        timeout=10,
    )
    # v2 carries no weight: only its own status changes.
    assert await replica.version_status("v2") == NOT_SERVING
    assert await replica.version_status("v1") == SERVING
    assert await replica.status() == SERVING
    # A version never loaded here is unknown to the health service: Envoy counts it down.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await replica.version_status("v9")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_draining_replica_reports_every_version_not_serving(replica: Replica) -> None:
    await replica.server.drain()
    for version in ("v1", "v2"):
        name = version_health_name("fraud", version)
        answer = await replica.server.health.Check(
            health_pb2.HealthCheckRequest(service=name),
            None,
        )
        assert answer.status == NOT_SERVING


async def test_a_version_the_spec_drops_is_unloaded(replica: Replica) -> None:
    await replica.change_spec({"v1": 100}, ("v1",))
    assert sorted(replica.server.repository.models()) == [("fraud", "v1")]
    assert await replica.version_status("v2") == NOT_SERVING
    assert await replica.status() == SERVING


async def test_readiness_follows_a_live_weight_change(replica: Replica) -> None:
    """v2 is not loaded when the spec starts routing to it: the replica is NOT_SERVING until
    it caught up (loaded and warmed v2), then SERVING again."""
    await replica.change_spec({"v1": 100}, ("v1",))
    assert await replica.status() == SERVING
    replica.loader.hold()
    moving = asyncio.create_task(replica.change_spec({"v1": 50, "v2": 50}, ("v1", "v2")))
    await asyncio.wait_for(replica.loader.waiting.wait(), timeout=30)
    # The spec routes to v2, the replica lacks it: out of Envoy's rotation.
    assert await replica.status() == NOT_SERVING
    assert replica.server.missing() == [("fraud", "v2")]
    replica.loader.release()
    await asyncio.wait_for(moving, timeout=60)
    assert await replica.status() == SERVING
    assert await replica.version_status("v2") == SERVING


async def test_a_load_request_with_a_bad_config_is_refused_naming_it(replica: Replica) -> None:
    params = {
        LOAD_VERSION_PARAMETER: oip.ModelRepositoryParameter(string_param="v2"),
        LOAD_CONFIG_PARAMETER: oip.ModelRepositoryParameter(string_param='{"batching": 3}'),
    }
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await replica.stub.RepositoryModelLoad(
            oip.RepositoryModelLoadRequest(model_name="fraud", parameters=params), timeout=10
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"parameters['{LOAD_CONFIG_PARAMETER}']" in (refused.value.details() or "")


async def test_a_brought_config_sets_the_batching_until_the_spec_lists_the_model(
    artifacts: dict[int, Artifact],
) -> None:
    specs = LoadSpecs(MeshSpec(models={}, feature_views={}))
    brought = ModelSpec(
        versions={"v1": ModelVersionSpec()},
        traffic={"v1": 100},
        batching=BatchingSpec(max_batch_size=8),
    )
    specs.bring("fraud", brought)
    fetch = FakeRegistry([(record(artifacts[1]), artifacts[1].data)] * 2)
    load = registry_loader(CHANNEL, specs.current, fetch=fetch)
    loaded = await load("fraud", "v1")
    assert loaded.batching.max_batch_size == 8
    await loaded.close()
    # Once the spec lists the model, the spec governs.
    specs.follow(MeshSpec())
    loaded = await load("fraud", "v1")
    assert loaded.batching.max_batch_size == BatchingSpec().max_batch_size
    await loaded.close()
