"""Many models in one pool: versions load on their first call, under a memory budget.

In-process model servers (real gRPC, real TorchScript loads of the demo MLP, ~1.19 MB of
weights each) with a loader the test can count and hold; and the operator's `models load`
and `models unload` against a real model server process pulling from a real registry.
Nothing sleeps to order events: a held load is a gate the test opens, and what the test
waits for (a load that began, calls that are waiting) it reads from the server itself.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.cli import main
from servemesh.contract.control_credential import control_metadata_for, ensure_control_token
from servemesh.contract.demo import Artifact, demo_artifact
from servemesh.contract.wire import LOAD_WAIT_PARAMETER, version_health_name
from servemesh.identity import dial_registry, dial_service
from servemesh.procs import Child, GrpcHealth, Supervisor
from servemesh.registry.client import push_version
from servemesh.services.model.app import build_server
from servemesh.services.model.errors import LoadError
from servemesh.services.model.loader import LoadedModel, load_model
from servemesh.services.model.readiness import ModelServer
from servemesh.services.model.repository import ModelRepository
from servemesh.spec import (
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    PoolSpec,
    Ports,
    Replicas,
    ResolvedSpec,
    dump_spec,
    resolve,
)
from servemesh.state.paths import MeshPaths
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2
from tests.control_kit import accept_test_credential, credentialed_channel
from tests.model.model_helpers import SIGNATURE, Stub, rows
from tests.waiting import wait_until_async

POOL = "many"
REPLICA = f"model-{POOL}-zone-a-0"
MODELS = ("m0", "m1", "m2")
# Two demo MLPs (2 x 1,185,796 bytes of weights) fit, three do not.
TWO_MODELS = "2.5MiB"
SERVING = health_pb2.HealthCheckResponse.SERVING


def pool_spec(budget: str | None = TWO_MODELS, models: tuple[str, ...] = MODELS) -> MeshSpec:
    return MeshSpec(
        zones=["zone-a"],
        ports=Ports.free(),
        models={
            name: ModelSpec(
                pool=POOL,
                versions={"v1": ModelVersionSpec(source="registry")},
                traffic={"v1": 100},
            )
            for name in models
        },
        pools={POOL: PoolSpec.model_validate({"memory_budget": budget, "load": "on_demand"})},
    )


class CountingLoader:
    """Loads each model as a demo MLP (a seed of its own); counts loads, and while `held`
    each load waits at a gate the test opens, after announcing itself (`entered`)."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.entered = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.broken: set[str] = set()
        self._artifacts: dict[str, Artifact] = {}

    def hold(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    def open(self) -> None:
        assert self.gate is not None
        self.gate.set()

    async def __call__(self, model: str, version: str) -> LoadedModel:
        self.loads.append(model)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if model in self.broken:
            raise LoadError(f"model {model!r} version {version!r}: the artifact is damaged")
        if model not in self._artifacts:
            self._artifacts[model] = demo_artifact(10 + len(self._artifacts))
        artifact = self._artifacts[model]
        return await load_model(
            artifact.data, model=model, version=version, sha256=artifact.sha256, signature=SIGNATURE
        )


Replica = tuple[ModelServer, ModelRepository, CountingLoader, Stub]


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    loader = CountingLoader()
    server = await build_server(resolve(pool_spec()), REPLICA, loader=loader, tls=False)
    assert isinstance(server, ModelServer)
    accept_test_credential(server)
    await server.start()
    channel = credentialed_channel(f"127.0.0.1:{server.port}")
    try:
        yield (
            server,
            server.repository,
            loader,
            grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel),
        )
    finally:
        await channel.close()
        await server.drain()


def call(model: str) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=model, id="r")
    batch = rows(1)
    request.inputs.add(name="features", datatype="FP32", shape=list(batch.shape))
    request.raw_input_contents.append(batch.tobytes())
    return request


def score(response: oip.ModelInferResponse) -> float:
    return float(np.frombuffer(response.raw_output_contents[0], dtype="<f4")[0])


def loaded(repository: ModelRepository) -> list[str]:
    return sorted(model for model, _ in repository.models())


# --- the spec ---------------------------------------------------------------------------


def test_a_budget_implies_on_demand_and_refuses_eager() -> None:
    assert PoolSpec.model_validate({"memory_budget": "64MiB"}).on_demand
    assert PoolSpec.model_validate({"memory_budget": "64MiB"}).memory_budget == 64 << 20
    assert PoolSpec(load="on_demand").on_demand
    assert not PoolSpec().on_demand
    with pytest.raises(ValueError, match="needs load: on_demand"):
        PoolSpec.model_validate({"memory_budget": "64MiB", "load": "eager"})
    with pytest.raises(ValueError, match="greater than or equal"):
        PoolSpec.model_validate({"memory_budget": 1000})
    # The resolved spec keeps the budget in bytes (what the servers read).
    spec = resolve(pool_spec())
    assert spec.pools[POOL].memory_budget == int(2.5 * (1 << 20))


# --- loads on a call ----------------------------------------------------------------------


async def test_a_version_loads_on_its_first_call_and_the_replica_is_ready_before(
    replica: Replica,
) -> None:
    server, repository, loader, stub = replica
    # Nothing loaded, yet ready: every version is loadable, and Envoy routes to each.
    assert loaded(repository) == [] and server.is_ready()
    assert (await stub.ServerReady(oip.ServerReadyRequest(), timeout=5)).ready
    channel = credentialed_channel(f"127.0.0.1:{server.port}")
    async with channel:
        checks = health_pb2_grpc.HealthStub(channel)
        for model in MODELS:
            name = version_health_name(model, "v1")
            answer = await checks.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert answer.status == SERVING, name

    first = await stub.ModelInfer(call("m0"), timeout=30)
    assert 0.0 < score(first) < 1.0
    assert first.parameters[LOAD_WAIT_PARAMETER].double_param > 0
    second = await stub.ModelInfer(call("m0"), timeout=30)
    assert LOAD_WAIT_PARAMETER not in second.parameters
    assert score(second) == score(first)
    assert loader.loads == ["m0"] and loaded(repository) == ["m0"]
    assert (repository.stats.hits, repository.stats.misses) == (1, 1)
    assert server.is_ready()
    # RepositoryIndex: the loaded version READY, the others loadable.
    index = await stub.RepositoryIndex(oip.RepositoryIndexRequest(), timeout=5)
    states = {m.name: m.state for m in index.models}
    assert states == {"m0": "READY", "m1": "UNAVAILABLE", "m2": "UNAVAILABLE"}


async def test_concurrent_first_calls_share_one_load(replica: Replica) -> None:
    _, repository, loader, stub = replica
    loader.hold()
    calls = [asyncio.ensure_future(stub.ModelInfer(call("m1"), timeout=30)) for _ in range(8)]
    await asyncio.wait_for(loader.entered.wait(), 30)
    # Every call is waiting for the one load before it is let through.
    await wait_until_async(lambda: repository.stats.misses == 8, "eight calls waiting")
    loader.open()
    answers = await asyncio.gather(*calls)
    assert len({score(a) for a in answers}) == 1
    assert loader.loads == ["m1"]


async def test_the_least_recently_used_version_is_evicted_at_the_budget(
    replica: Replica,
) -> None:
    server, repository, loader, stub = replica
    for model in ("m0", "m1", "m0"):
        await stub.ModelInfer(call(model), timeout=30)
    assert loaded(repository) == ["m0", "m1"]
    # m2 passes the budget of two: m1, used least recently, makes room.
    await stub.ModelInfer(call("m2"), timeout=30)
    assert loaded(repository) == ["m0", "m2"]
    # m1 again: m0 (used before m2) goes, and m1 loads a second time.
    again = await stub.ModelInfer(call("m1"), timeout=30)
    assert again.parameters[LOAD_WAIT_PARAMETER].double_param > 0
    assert loaded(repository) == ["m1", "m2"]
    assert loader.loads == ["m0", "m1", "m2", "m1"]
    assert repository.stats.evictions == 2
    assert repository.used_bytes() <= int(2.5 * (1 << 20))
    # An evicted version is loadable, not missing: the replica stays ready.
    assert server.is_ready() and server.missing() == []


async def test_a_version_with_a_call_in_flight_is_not_evicted(replica: Replica) -> None:
    _, repository, loader, stub = replica
    await stub.ModelInfer(call("m0"), timeout=30)
    await stub.ModelInfer(call("m1"), timeout=30)
    # A call holds m0 (the least recently used): m1 makes room instead.
    held, _ = await repository.acquire("m0", "v1", deadline=time.monotonic() + 30)
    try:
        await stub.ModelInfer(call("m1"), timeout=30)  # m1 is now the most recent use...
        await stub.ModelInfer(call("m2"), timeout=30)  # ...yet the held m0 stays
        assert loaded(repository) == ["m0", "m2"]
    finally:
        repository.release(held)
    assert loader.loads == ["m0", "m1", "m2"]


async def test_a_call_shorter_than_the_load_gets_deadline_exceeded_and_the_load_completes(
    replica: Replica,
) -> None:
    _, repository, loader, stub = replica
    loader.hold()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ModelInfer(call("m2"), timeout=0.5)
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert loader.entered.is_set()
    loader.open()
    await wait_until_async(lambda: ("m2", "v1") in repository.models(), "the load to finish")
    after = await stub.ModelInfer(call("m2"), timeout=30)
    assert LOAD_WAIT_PARAMETER not in after.parameters
    assert loader.loads == ["m2"]


async def test_a_failed_load_answers_its_reason_without_a_load_per_call(
    replica: Replica,
) -> None:
    _, repository, loader, stub = replica
    loader.broken.add("m1")
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ModelInfer(call("m1"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "the artifact is damaged" in (refused.value.details() or "")
    assert loader.loads == ["m1"]  # one load; the next calls are told its reason
    assert repository.stats.load_failures == 1
    # A version no spec names is not loaded at all.
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await stub.ModelInfer(call("nope"), timeout=30)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


# --- the operator's model control, against a real model server process -------------------


def _start(
    supervisor: Supervisor, module: str, instance: str, spec_file: Path, dial: object
) -> Child:
    argv = [sys.executable, "-m", module, "--spec", str(spec_file), "--instance", instance]
    return supervisor.start(instance, argv, ready=GrpcHealth(dial), timeout_s=60)  # type: ignore[arg-type]


async def _index(spec: ResolvedSpec) -> dict[str, str]:
    async with dial_service(spec, REPLICA).aio_channel() as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        index = await stub.RepositoryIndex(oip.RepositoryIndexRequest(ready=True), timeout=10)
    return {m.name: m.state for m in index.models}


async def test_models_load_and_unload_through_the_cli_on_a_pool_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    spec = resolve(
        pool_spec().model_copy(
            update={
                "state_dir": str(state),
                "model_servers": Replicas(per_zone={"zone-a": 1}),
                "gateway": Replicas(per_zone={"zone-a": 1}),
                "feature": Replicas(per_zone={"zone-a": 1}),
            }
        )
    )
    spec_file = tmp_path / "mesh.yaml"
    spec_file.write_text(dump_spec(spec))
    ensure_control_token(spec.state_dir)
    # What the commands read of a running mesh.
    MeshPaths(state).resolved_spec.write_text(dump_spec(spec))
    with Supervisor(tmp_path / "logs") as supervisor:
        await asyncio.to_thread(
            _start, supervisor, "servemesh.registry", "registry-0", spec_file, dial_registry(spec)
        )
        async with dial_registry(spec).aio_channel() as channel:
            for seed, model in enumerate(MODELS, start=1):
                await push_version(
                    channel,
                    model=model,
                    version="v1",
                    data=demo_artifact(seed).data,
                    inputs=[
                        registry_pb2.TensorSpec(name="features", datatype="FP32", shape=[-1, 64])
                    ],
                    outputs=[registry_pb2.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])],
                    credential=control_metadata_for(spec.state_dir),
                )
        # The pool's server turns SERVING with nothing loaded (its versions are loadable).
        await asyncio.to_thread(
            _start,
            supervisor,
            "servemesh.services.model",
            REPLICA,
            spec_file,
            dial_service(spec, REPLICA),
        )
        assert await _index(spec) == {}

        flags = ["--state-dir", str(state)]
        assert await asyncio.to_thread(main, ["models", "load", "m0", "v1", *flags]) == 0
        assert (
            await asyncio.to_thread(main, ["models", "load", "m1", "v1", "--pool", POOL, *flags])
            == 0
        )
        assert await _index(spec) == {"m0": "READY", "m1": "READY"}
        # A third passes the budget of two: the least recently used (m0) makes room.
        assert await asyncio.to_thread(main, ["models", "load", "m2", "v1", *flags]) == 0
        assert await _index(spec) == {"m1": "READY", "m2": "READY"}
        assert await asyncio.to_thread(main, ["models", "unload", "m2", "v1", *flags]) == 0
        assert await _index(spec) == {"m1": "READY"}
        # Refused: a pool that does not serve the model, a version no spec names.
        assert (
            await asyncio.to_thread(main, ["models", "load", "m0", "v1", "--pool", "x", *flags])
            != 0
        )
        assert await asyncio.to_thread(main, ["models", "load", "m0", "v9", *flags]) != 0
        # Without the control credential the replica refuses the load itself.
        async with dial_service(spec, REPLICA).aio_channel() as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RepositoryModelLoad(
                    oip.RepositoryModelLoadRequest(
                        model_name="m0",
                        parameters={"version": oip.ModelRepositoryParameter(string_param="v1")},
                    ),
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # A call still loads what it names, through the same process.
            answer = await stub.ModelInfer(call("m0"), timeout=60)
            assert answer.parameters[LOAD_WAIT_PARAMETER].double_param > 0
        assert await _index(spec) == {"m0": "READY", "m1": "READY"}
