"""A model server's readiness runs its models; its liveness is a separate answer.

In-process servers (a real gRPC port, the real health service) for what needs a model
whose behaviour the test flips while it serves; a real model server process, pulling its
versions from a real registry process and following its spec file, for a bad version
loaded live and unloaded again.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.control_credential import control_metadata_for, ensure_control_token
from servemesh.contract.wire import (
    LIVENESS_HEALTH_NAME,
    OIP_SERVICE,
    READINESS_HEALTH_NAME,
    version_health_name,
)
from servemesh.identity import Dial, dial_registry, dial_service
from servemesh.procs import Child, GrpcHealth, Supervisor
from servemesh.registry.client import push_version
from servemesh.services.model.batching import Batcher
from servemesh.services.model.loader import LoadedModel, warm_up_sizes
from servemesh.services.model.readiness import ModelServer
from servemesh.services.model.runner import ModelRunner, NonFiniteOutput
from servemesh.services.model.service import InferenceServicer
from servemesh.spec import (
    BatchingSpec,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    Replicas,
    ResolvedSpec,
    dump_spec,
    resolve,
)
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2
from tests.model.model_helpers import FEATURES, SIGNATURE, rows
from tests.model.test_model_metrics import scrape
from tests.model.test_model_server import infer_request
from tests.waiting import wait_until_async

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READINESS_NAMES = ("", READINESS_HEALTH_NAME, OIP_SERVICE)


class Scaled(torch.nn.Module):
    """score = sum(features) * scale. Fine at scale 1; NaN for every row at scale NaN.

    `hang()` makes the next forward pass wait in the model's thread until `release()`.
    """

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self._gate: threading.Event | None = None
        self.entered = threading.Event()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        gate = self._gate
        if gate is not None:
            self.entered.set()
            gate.wait(timeout=60)  # bounded: a test that fails never leaves a thread behind
        return features.sum(dim=1, keepdim=True) * self.scale

    def hang(self) -> None:
        self._gate = threading.Event()

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()


class ScriptedScale(torch.nn.Module):
    """The TorchScript form: a model server process loads these bytes from the registry."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.sum(dim=1, keepdim=True) * self.scale


async def _loaded(module: Scaled, version: str = "v1") -> LoadedModel:
    batching = BatchingSpec(max_batch_size=8)
    runner = ModelRunner(module, model="fraud", version=version, signature=SIGNATURE)
    batcher = Batcher(runner, batching, name=f"fraud:{version}")
    await batcher.warm_up(warm_up_sizes(batching))
    return LoadedModel(
        model="fraud",
        version=version,
        signature=SIGNATURE,
        batching=batching,
        runner=runner,
        batcher=batcher,
        sha256="0" * 64,
    )


async def _health(channel: grpc.aio.Channel, name: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
    return answer.status


async def _readiness(channel: grpc.aio.Channel) -> set[int]:
    """Every readiness name's status (they always agree: one status when they do)."""
    return {await _health(channel, name) for name in READINESS_NAMES}


@asynccontextmanager
async def _serving(
    module: Scaled, **checks: float
) -> AsyncIterator[tuple[ModelServer, grpc.aio.Channel]]:
    """A model server on a free port serving fraud v1 (routed) from `module`."""
    loaded = await _loaded(module)

    async def loader(model: str, version: str) -> LoadedModel:
        return loaded

    servicer = InferenceServicer(
        replica="model-fraud-zone-a-0", loader=loader, expected=[("fraud", "v1")]
    )
    repository = servicer.repository
    await repository.load_all()
    server = ModelServer(
        "model-fraud-zone-a-0", repository=repository, routed=[("fraud", "v1")], port=0, **checks
    )
    servicer.readiness = server.is_ready
    server.add_service(
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, servicer, OIP_SERVICE
    )
    server.on_stop(repository.close)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, channel
    finally:
        module.release()
        await channel.close()
        await server.drain()


def test_the_check_refuses_non_finite_outputs_and_passes_finite_ones() -> None:
    module = Scaled()
    runner = ModelRunner(module, model="fraud", version="v1", signature=SIGNATURE)
    answer = runner.check()
    assert isinstance(answer, np.ndarray) and answer.shape == (1, 1)
    module.scale = float("inf")  # 0 * inf: NaN on the very rows it warmed up on
    with pytest.raises(NonFiniteOutput, match="not finite"):
        runner.check()


class RefusesLargeInputs(torch.nn.Module):
    """A model that validates its own input: it raises on values above 0.5 (a canary's
    defect, or a rule of its own), and answers the zeros it warmed up on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 0.5).any()):
            raise RuntimeError("input out of range")
        return x[:, :1]


def test_the_check_asks_whether_the_model_still_answers_as_it_warmed_up() -> None:
    # Readiness is not an input test: a version that refuses some inputs on purpose stays
    # ready (the rollout's analysis judges its errors on real traffic).
    runner = ModelRunner(RefusesLargeInputs(), model="fraud", version="v1", signature=SIGNATURE)
    runner.warm_up([1])
    answer = runner.check()
    assert isinstance(answer, np.ndarray) and answer.shape == (1, 1)


async def test_a_healthy_model_server_is_ready_and_alive() -> None:
    async with _serving(Scaled(), check_interval_s=0.05) as (server, channel):
        # Rounds of checks ran (their results change), and both answers stay SERVING.
        first = server.checks.results[("fraud", "v1")]
        await wait_until_async(
            lambda: server.checks.results[("fraud", "v1")].at > first.at, "a later check"
        )
        assert await _readiness(channel) == {SERVING}
        assert await _health(channel, LIVENESS_HEALTH_NAME) == SERVING
        assert await _health(channel, version_health_name("fraud", "v1")) == SERVING
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert (await stub.ServerReady(oip.ServerReadyRequest(), timeout=5)).ready


async def test_outputs_turning_nan_make_the_server_not_ready_but_still_alive() -> None:
    module = Scaled()
    async with _serving(module, check_interval_s=0.05) as (server, channel):
        assert await _readiness(channel) == {SERVING}
        module.scale = float("nan")  # the model goes bad while it serves
        await wait_until_async(lambda: not server.is_ready(), "readiness to turn NOT_SERVING")
        assert await _readiness(channel) == {NOT_SERVING}
        assert await _health(channel, version_health_name("fraud", "v1")) == NOT_SERVING
        result = server.checks.results[("fraud", "v1")]
        assert not result.ok and "not finite" in result.reason
        assert await _health(channel, LIVENESS_HEALTH_NAME) == SERVING
        module.scale = 1.0
        await wait_until_async(server.is_ready, "readiness to return")
        assert await _readiness(channel) == {SERVING}
        assert await _health(channel, version_health_name("fraud", "v1")) == SERVING


async def test_a_hung_model_fails_readiness_first_and_liveness_once_stuck_for_good() -> None:
    module = Scaled()
    async with _serving(module, check_interval_s=0.05, check_timeout_s=0.3, stall_s=2.0) as (
        server,
        channel,
    ):
        module.hang()
        await asyncio.to_thread(module.entered.wait, 30)
        await wait_until_async(lambda: not server.is_ready(), "readiness to turn NOT_SERVING")
        assert "no answer" in server.checks.results[("fraud", "v1")].reason
        # Stuck for less than stall_s: not ready, but alive (a restart is not due yet).
        if server.checks.stalled(server.repository.models()) == []:
            assert await _health(channel, LIVENESS_HEALTH_NAME) == SERVING
        await wait_until_async(lambda: not server.is_alive(), "liveness to turn NOT_SERVING")
        assert await _health(channel, LIVENESS_HEALTH_NAME) == NOT_SERVING
        module.release()
        await wait_until_async(server.is_alive, "liveness to return")
        await wait_until_async(server.is_ready, "readiness to return")
        assert await _readiness(channel) == {SERVING}


async def test_a_drain_turns_readiness_not_serving_and_leaves_liveness_serving() -> None:
    async with _serving(Scaled()) as (server, _):
        await server.drain()
        for name in READINESS_NAMES:
            answer = await server.health.Check(health_pb2.HealthCheckRequest(service=name), None)
            assert answer.status == NOT_SERVING
        request = health_pb2.HealthCheckRequest(service=LIVENESS_HEALTH_NAME)
        assert (await server.health.Check(request, None)).status == SERVING


# --- a real model server process ---------------------------------------------------------

MODEL_INSTANCE = "model-fraud-zone-a-0"


def _scripted(scale: float) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(ScriptedScale(scale)), buffer)
    return buffer.getvalue()


def _model(traffic: dict[str, int]) -> ModelSpec:
    return ModelSpec(
        versions={version: ModelVersionSpec(source="demo:1") for version in traffic},
        traffic=traffic,
        batching=BatchingSpec(max_batch_size=8),
    )


def _write(spec_file: Path, spec: ResolvedSpec) -> None:
    """Atomically, as `servemesh apply` does: the replica sees one whole file or the other."""
    staged = spec_file.with_suffix(".tmp")
    staged.write_text(dump_spec(spec))
    os.replace(staged, spec_file)


def _start(
    supervisor: Supervisor, module: str, instance: str, spec_file: Path, dial: Dial
) -> Child:
    argv = [sys.executable, "-m", module, "--spec", str(spec_file), "--instance", instance]
    return supervisor.start(instance, argv, ready=GrpcHealth(dial), timeout_s=60)


def _check_ok(address: str, version: str) -> float | None:
    samples = scrape(address)
    key = ("servemesh_model_check_ok", (("model", "fraud"), ("version", version)))
    return samples.get(key)


def _check_at(address: str, version: str) -> float:
    key = ("servemesh_model_check_timestamp_seconds", (("model", "fraud"), ("version", version)))
    return scrape(address).get(key, 0.0)


@pytest.fixture
def registry_and_spec(tmp_path: Path) -> Iterator[tuple[Supervisor, ResolvedSpec, Path]]:
    spec = resolve(
        MeshSpec(
            zones=["zone-a"],
            ports=Ports.free(),
            state_dir=str(tmp_path / "state"),
            model_servers=Replicas(per_zone={"zone-a": 1}),
            gateway=Replicas(per_zone={"zone-a": 1}),
            feature=Replicas(per_zone={"zone-a": 1}),
            models={"fraud": _model({"v1": 100})},
        )
    )
    spec_file = tmp_path / "mesh.yaml"
    _write(spec_file, spec)
    ensure_control_token(spec.state_dir)
    with Supervisor(tmp_path) as supervisor:
        _start(supervisor, "servemesh.registry", "registry-0", spec_file, dial_registry(spec))
        yield supervisor, spec, spec_file


async def test_a_nan_version_loaded_live_makes_the_process_not_ready_until_it_is_unloaded(
    registry_and_spec: tuple[Supervisor, ResolvedSpec, Path],
) -> None:
    supervisor, spec, spec_file = registry_and_spec
    async with dial_registry(spec).aio_channel() as channel:
        for version, scale in (("v1", 1.0), ("v2", float("nan"))):
            await push_version(
                channel,
                model="fraud",
                version=version,
                data=_scripted(scale),
                inputs=[
                    registry_pb2.TensorSpec(name="features", datatype="FP32", shape=[-1, FEATURES])
                ],
                outputs=[registry_pb2.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])],
                credential=control_metadata_for(spec.state_dir),
            )
    await asyncio.to_thread(
        _start,
        supervisor,
        "servemesh.services.model",
        MODEL_INSTANCE,
        spec_file,
        dial_service(spec, MODEL_INSTANCE),
    )
    metrics = spec.metrics_address_of(MODEL_INSTANCE)
    v2 = version_health_name("fraud", "v2")
    async with dial_service(spec, MODEL_INSTANCE).aio_channel() as channel:
        # Healthy: ready and alive, v1's check passed.
        assert await _readiness(channel) == {SERVING}
        assert await _health(channel, LIVENESS_HEALTH_NAME) == SERVING
        assert await asyncio.to_thread(_check_ok, metrics, "v1") == 1.0

        # v2 (NaN for every row; its load and warm-up check neither values nor NaN) is
        # routed half the traffic live: the replica loads it, and its check fails.
        _write(
            spec_file, spec.model_copy(update={"models": {"fraud": _model({"v1": 50, "v2": 50})}})
        )

        # Readiness turns NOT_SERVING at once (v2 routed, not loaded yet); what counts is
        # that it stays so once v2 is loaded and its first check has failed.
        async def v2_failed() -> bool:
            return await asyncio.to_thread(_check_ok, metrics, "v2") == 0.0

        await _wait_async(v2_failed, "v2 loaded and its check failed")
        assert await _readiness(channel) == {NOT_SERVING}
        assert await _health(channel, v2) == NOT_SERVING
        assert await _health(channel, version_health_name("fraud", "v1")) == SERVING
        # Later rounds keep failing v2, and liveness stays SERVING through them.
        first = await asyncio.to_thread(_check_at, metrics, "v2")
        await _wait_async(lambda: _later(metrics, "v2", first), "a later check of v2", timeout_s=30)
        assert await _health(channel, LIVENESS_HEALTH_NAME) == SERVING
        assert await _readiness(channel) == {NOT_SERVING}
        # v1 still answers real scores meanwhile.
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = await stub.ModelInfer(infer_request(rows(1), version="v1"), timeout=10)
        assert np.isfinite(np.frombuffer(reply.raw_output_contents[0], dtype="<f4")).all()

        # The spec drops v2: the replica stops counting it at once and unloads it (its
        # check result and metrics go with it); readiness is SERVING again.
        _write(spec_file, spec)

        async def v2_unloaded() -> bool:
            return await asyncio.to_thread(_check_ok, metrics, "v2") is None

        await _wait_async(v2_unloaded, "v2 to be unloaded")
        assert await _readiness(channel) == {SERVING}
        assert await _health(channel, v2) == NOT_SERVING
        assert await _health(channel, LIVENESS_HEALTH_NAME) == SERVING


async def _later(metrics: str, version: str, than: float) -> bool:
    return await asyncio.to_thread(_check_at, metrics, version) > than


async def _wait_async(
    condition: Callable[[], Awaitable[bool]], what: str, *, timeout_s: float = 60.0
) -> None:
    """Poll an async condition until it holds (bounded), as wait_until_async does."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while not await condition():
        if loop.time() > give_up:
            pytest.fail(f"waited {timeout_s:.0f} s for {what}")
        await asyncio.sleep(0.05)
