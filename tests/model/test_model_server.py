"""The OIP v2 servicer over a real grpc.aio server on loopback, hosting the demo model."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.demo import Artifact
from servemesh.contract.wire import SHADOW_ROLE_HEADER
from servemesh.services.model.app import SERVICE_NAME, build_server
from servemesh.services.model.errors import LoadError
from servemesh.services.model.loader import LoadedModel, load_model
from servemesh.services.model.repository import natural_key
from servemesh.services.model.service import InferenceServicer
from servemesh.services.model.shadow import ShadowLedger, ShadowRecorder
from servemesh.spec import BatchingSpec, MeshSpec, Ports, resolve
from servemesh_api.inference import grpc_service_pb2 as oip
from tests.model.model_helpers import (
    FEATURES,
    REPLICA,
    SIGNATURE,
    GatedLoader,
    Stub,
    marked,
    reference_scores,
    rows,
    serving,
)

Loader = Callable[[str, str], Awaitable[LoadedModel]]


def demo_loader(
    artifacts: dict[int, Artifact],
    inject_latency_ms: float = 0.0,
    batching: BatchingSpec | None = None,
) -> Loader:
    """Loads fraud v1/v2 straight from the demo artifacts: no registry involved."""

    async def load(model: str, version: str) -> LoadedModel:
        seed = {"v1": 1, "v2": 2}.get(version)
        if model != "fraud" or seed is None:
            raise LoadError(
                f"model {model!r} version {version!r}: no such demo", code=grpc.StatusCode.NOT_FOUND
            )
        artifact = artifacts[seed]
        return await load_model(
            artifact.data,
            model=model,
            version=version,
            sha256=artifact.sha256,
            signature=SIGNATURE,
            inject_latency_ms=inject_latency_ms,
            batching=batching,
        )

    return load


@pytest.fixture
async def fraud(artifacts: dict[int, Artifact]) -> AsyncIterator[tuple[Stub, InferenceServicer]]:
    servicer = InferenceServicer(
        replica=REPLICA,
        zone="zone-a",
        loader=demo_loader(artifacts),
        expected=[("fraud", "v1"), ("fraud", "v2")],
    )
    await servicer.repository.load_all()
    async with serving(servicer) as (stub, _):
        yield stub, servicer


def infer_request(
    batch: np.ndarray, raw: bool = True, version: str = "", **extra: Any
) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name="fraud", model_version=version, id="req-1", **extra)
    tensor = request.inputs.add(name="features", datatype="FP32", shape=list(batch.shape))
    if raw:
        request.raw_input_contents.append(batch.tobytes())
    else:
        tensor.contents.fp32_contents.extend(batch.ravel().tolist())
    return request


def scores_of(response: oip.ModelInferResponse) -> np.ndarray:
    [output] = response.outputs
    assert output.name == "score" and output.datatype == "FP32"
    if response.raw_output_contents:
        values = np.frombuffer(response.raw_output_contents[0], dtype="<f4")
    else:
        values = np.asarray(output.contents.fp32_contents, dtype=np.float32)
    return values.reshape(list(output.shape))


async def test_raw_and_typed_requests_score_like_the_torchscript_model(
    fraud: tuple[Stub, InferenceServicer], reference: dict[int, torch.jit.ScriptModule]
) -> None:
    stub, _ = fraud
    batch = rows(3)
    expected = reference_scores(reference[1], batch)
    raw = await stub.ModelInfer(infer_request(batch, raw=True, version="v1"), timeout=5)
    typed = await stub.ModelInfer(infer_request(batch, raw=False, version="v1"), timeout=5)
    assert raw.raw_output_contents and not typed.raw_output_contents  # answers mirror requests
    np.testing.assert_allclose(scores_of(raw), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores_of(typed), expected, rtol=1e-5, atol=1e-6)
    assert (raw.model_name, raw.model_version, raw.id) == ("fraud", "v1", "req-1")
    assert raw.parameters["servemesh_replica"].string_param == REPLICA
    assert raw.parameters["servemesh_zone"].string_param == "zone-a"


async def test_version_comes_from_request_then_envoy_header_then_highest_loaded(
    fraud: tuple[Stub, InferenceServicer], reference: dict[int, torch.jit.ScriptModule]
) -> None:
    stub, _ = fraud
    batch = rows(2, seed=3)
    default = await stub.ModelInfer(infer_request(batch), timeout=5)
    assert default.model_version == "v2"
    np.testing.assert_allclose(
        scores_of(default), reference_scores(reference[2], batch), rtol=1e-5, atol=1e-6
    )
    header = [("x-servemesh-model-version", "v1")]
    routed = await stub.ModelInfer(infer_request(batch), metadata=header, timeout=5)
    assert routed.model_version == "v1"
    np.testing.assert_allclose(
        scores_of(routed), reference_scores(reference[1], batch), rtol=1e-5, atol=1e-6
    )
    pinned = await stub.ModelInfer(infer_request(batch, version="v2"), metadata=header, timeout=5)
    assert pinned.model_version == "v2"
    assert sorted(["v10", "v9", "v2"], key=natural_key) == ["v2", "v9", "v10"]


async def test_health_and_metadata_endpoints(fraud: tuple[Stub, InferenceServicer]) -> None:
    stub, _ = fraud
    assert (await stub.ServerLive(oip.ServerLiveRequest())).live
    assert (await stub.ServerReady(oip.ServerReadyRequest())).ready
    assert (await stub.ModelReady(oip.ModelReadyRequest(name="fraud", version="v1"))).ready
    assert (await stub.ModelReady(oip.ModelReadyRequest(name="fraud"))).ready
    assert not (await stub.ModelReady(oip.ModelReadyRequest(name="fraud", version="v7"))).ready
    server = await stub.ServerMetadata(oip.ServerMetadataRequest())
    assert server.name == "servemesh" and list(server.extensions) == [
        "model_repository",
        "statistics",
    ]
    meta = await stub.ModelMetadata(oip.ModelMetadataRequest(name="fraud"))
    assert meta.platform == "pytorch_torchscript" and list(meta.versions) == ["v1", "v2"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("features", "FP32", [-1, FEATURES])
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("score", "FP32", [-1, 1])
    ]


@pytest.mark.parametrize(
    ("model", "version", "message"),
    [
        ("nope", "", "model 'nope' is not loaded"),
        ("fraud", "v9", "model 'fraud' version 'v9' is not loaded; loaded: ['v1', 'v2']"),
    ],
)
async def test_unknown_model_or_version_is_not_found(
    fraud: tuple[Stub, InferenceServicer], model: str, version: str, message: str
) -> None:
    stub, _ = fraud
    request = infer_request(rows(1), version=version)
    request.model_name = model
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(request, timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == message
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelMetadata(oip.ModelMetadataRequest(name=model, version=version))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_malformed_request_is_invalid_argument_and_the_replica_keeps_serving(
    fraud: tuple[Stub, InferenceServicer],
) -> None:
    stub, _ = fraud
    bad = infer_request(rows(2))
    del bad.inputs[0].shape[:]
    bad.inputs[0].shape.extend([2, 63])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(bad, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "inputs[0].shape: expected [-1, 64], got [2, 63]"
    bad_priority = infer_request(rows(1))
    bad_priority.parameters["priority"].string_param = "high"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(bad_priority, timeout=5)
    assert "parameters['priority']" in caught.value.details()
    assert len((await stub.ModelInfer(infer_request(rows(1)), timeout=5)).outputs) == 1


async def test_statistics_count_rows_and_model_calls(fraud: tuple[Stub, InferenceServicer]) -> None:
    stub, _ = fraud
    for n in (1, 2, 3):
        await stub.ModelInfer(infer_request(rows(n), version="v1"), timeout=5)
    stats = await stub.ModelStatistics(oip.ModelStatisticsRequest(name="fraud", version="v1"))
    [entry] = stats.model_stats
    assert entry.inference_count == 6 and entry.execution_count == 3
    assert entry.inference_stats.success.count == 3
    assert sum(b.compute_infer.count for b in entry.batch_stats) == 3
    everything = await stub.ModelStatistics(oip.ModelStatisticsRequest())
    assert [(s.name, s.version) for s in everything.model_stats] == [
        ("fraud", "v1"),
        ("fraud", "v2"),
    ]


async def test_repository_unload_and_load_through_the_injected_loader(
    fraud: tuple[Stub, InferenceServicer],
) -> None:
    stub, servicer = fraud
    index = await stub.RepositoryIndex(oip.RepositoryIndexRequest())
    assert [(m.name, m.version, m.state) for m in index.models] == [
        ("fraud", "v1", "READY"),
        ("fraud", "v2", "READY"),
    ]
    unload = oip.RepositoryModelUnloadRequest(model_name="fraud")
    unload.parameters["version"].string_param = "v2"
    await stub.RepositoryModelUnload(unload)
    assert (await stub.ModelInfer(infer_request(rows(1)), timeout=5)).model_version == "v1"
    load = oip.RepositoryModelLoadRequest(model_name="fraud")
    load.parameters["version"].string_param = "v2"
    await stub.RepositoryModelLoad(load)
    assert (await stub.ModelInfer(infer_request(rows(1)), timeout=5)).model_version == "v2"
    missing = oip.RepositoryModelLoadRequest(model_name="fraud")
    missing.parameters["version"].string_param = "v3"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.RepositoryModelLoad(missing)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    index = await stub.RepositoryIndex(oip.RepositoryIndexRequest())
    assert ("fraud", "v3", "UNAVAILABLE") in [(m.name, m.version, m.state) for m in index.models]
    assert servicer.repository.is_ready()


async def test_slow_model_refuses_a_request_whose_deadline_it_cannot_meet(
    artifacts: dict[int, Artifact], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    # Warm-up counts the injected 2 s without sleeping it; the model never runs here.
    servicer = InferenceServicer(
        replica=REPLICA, loader=demo_loader(artifacts, inject_latency_ms=2000)
    )
    await servicer.repository.load("fraud", "v1")
    batcher = servicer.repository.resolve("fraud", "v1").batcher
    async with serving(servicer) as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(
                infer_request(rows(1)), timeout=0.5, metadata=[("x-request-id", "slow-1")]
            )
        # The replica's refusal, sent before the caller's deadline: not an expiry.
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert caught.value.details().startswith("deadline cannot be met: ")
        # OIP's own `timeout` parameter (microseconds) counts too, even under a long gRPC deadline.
        request = infer_request(rows(1))
        request.parameters["timeout"].int64_param = 50_000
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(request, timeout=5, metadata=[("x-request-id", "slow-2")])
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert caught.value.details().startswith("deadline cannot be met: ")
    assert batcher.stats.executions == 0  # the model never ran either request
    dropped = [r for r in caplog.records if r.getMessage() == "dropped: deadline cannot be met"]
    assert [vars(r)["request_id"] for r in dropped] == ["slow-1", "slow-2"]
    assert all(vars(r)["expected_ms"] >= 2000 for r in dropped)


async def test_built_server_loads_every_spec_version_before_it_reports_serving(
    artifacts: dict[int, Artifact],
) -> None:
    spec = resolve(MeshSpec(ports=Ports.free()))
    server = await build_server(
        spec, "model-fraud-zone-b-0", loader=demo_loader(artifacts), tls=False
    )
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        check = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        stub = Stub(channel)
        assert (await stub.ServerReady(oip.ServerReadyRequest())).ready
        reply = await stub.ModelInfer(infer_request(rows(1), version="v1"), timeout=5)
        assert reply.parameters["servemesh_replica"].string_param == "model-fraud-zone-b-0"
        assert reply.parameters["servemesh_zone"].string_param == "zone-b"
    finally:
        await channel.close()
        await server.drain()


async def test_concurrent_calls_share_forward_passes_and_score_like_row_by_row(
    artifacts: dict[int, Artifact], reference: dict[int, torch.jit.ScriptModule]
) -> None:
    batching = BatchingSpec(max_batch_size=32, max_queue_delay_ms=50, dispatch="fixed_window")
    loader = GatedLoader(artifacts, batching)
    servicer = InferenceServicer(replica=REPLICA, loader=loader)
    await servicer.repository.load("fraud", "v1")
    model, batcher = loader.models["v1"], loader.batchers["v1"]
    requests = [rows(1 + i % 2, seed=i) for i in range(24)]
    async with serving(servicer) as (stub, _):
        calls = [
            asyncio.ensure_future(stub.ModelInfer(infer_request(r), timeout=5)) for r in requests
        ]
        for _ in requests:  # every call reaches the batcher while the first batch is held
            await batcher.admitted.get()
        model.open()
        replies = await asyncio.gather(*calls)
    rows_sent = sum(len(r) for r in requests)
    assert batcher.stats.inference_count == rows_sent == 36
    # Really batched over gRPC: the held batch, then the other rows in batches of <= 32.
    assert batcher.stats.executions <= 3
    for request, reply in zip(requests, replies, strict=True):
        np.testing.assert_allclose(
            scores_of(reply), reference_scores(reference[1], request), rtol=1e-5, atol=1e-6
        )


async def test_priority_parameter_follows_triton_levels(artifacts: dict[int, Artifact]) -> None:
    # priority_levels 2, default level 1: a request asking for 2 waits behind default traffic.
    batching = BatchingSpec(max_batch_size=1, max_queue_delay_ms=0)
    loader = GatedLoader(artifacts, batching)
    servicer = InferenceServicer(replica=REPLICA, loader=loader)
    await servicer.repository.load("fraud", "v1")
    model, batcher = loader.models["v1"], loader.batchers["v1"]

    async def call(stub: Stub, marker: float, name: str, priority: int) -> None:
        request = infer_request(marked(marker))
        if priority:
            request.parameters["priority"].int64_param = priority
        await stub.ModelInfer(request, timeout=5, metadata=[("x-request-id", name)])

    async with serving(servicer) as (stub, _):
        busy = asyncio.ensure_future(call(stub, 1.0, "busy", 0))
        assert await batcher.admitted.get() == "busy"
        await model.entered()  # the model is running "busy"
        low = asyncio.ensure_future(call(stub, 2.0, "low", 2))
        assert await batcher.admitted.get() == "low"
        default = asyncio.ensure_future(call(stub, 3.0, "default", 0))
        assert await batcher.admitted.get() == "default"
        model.open()
        await asyncio.gather(busy, low, default)
        assert model.order([1.0, 2.0, 3.0]) == [1.0, 3.0, 2.0]  # default overtook low
        bad = infer_request(rows(1))
        bad.parameters["priority"].int64_param = 3
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(bad, timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == (
            "parameters['priority']: 3 is outside 1..2 (0 means the default level, 1)"
        )


async def test_repository_load_failures_keep_their_status_without_internals(
    artifacts: dict[int, Artifact],
) -> None:
    demo = demo_loader(artifacts)

    async def failing_v3(model: str, version: str) -> LoadedModel:
        if version == "v3":
            raise OSError("disk /srv/models is gone")
        return await demo(model, version)

    servicer = InferenceServicer(replica=REPLICA, loader=failing_v3)
    async with serving(servicer) as (stub, _):
        broken = oip.RepositoryModelLoadRequest(model_name="fraud")
        broken.parameters["version"].string_param = "v3"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RepositoryModelLoad(broken)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert caught.value.details() == "load failed: OSError"
        index = await stub.RepositoryIndex(oip.RepositoryIndexRequest())
        # The operator's index says why; the caller's status did not.
        assert [(m.version, m.state, m.reason) for m in index.models] == [
            ("v3", "UNAVAILABLE", "OSError: disk /srv/models is gone")
        ]
        unnamed = oip.RepositoryModelLoadRequest(model_name="fraud")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RepositoryModelLoad(unnamed)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == (
            "parameters['version']: a string_param naming the version is required"
        )
    without_loader = InferenceServicer(replica=REPLICA)
    async with serving(without_loader) as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RepositoryModelLoad(broken)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert caught.value.details() == "model loading is not configured on this replica"


async def test_calls_beyond_the_in_flight_limit_are_refused_before_they_are_read(
    artifacts: dict[int, Artifact],
) -> None:
    # A slow model keeps the first call in flight; the limit is one call.
    servicer = InferenceServicer(
        replica=REPLICA, loader=demo_loader(artifacts, inject_latency_ms=300), max_in_flight=1
    )
    await servicer.repository.load("fraud", "v1")
    async with serving(servicer) as (stub, _):
        first = asyncio.ensure_future(stub.ModelInfer(infer_request(rows(1)), timeout=5))
        async with asyncio.timeout(5):
            while not servicer.in_flight:  # the first call was admitted
                await asyncio.sleep(0.005)
        # A malformed request proves the refusal comes before the request is read: no
        # INVALID_ARGUMENT, and the batcher never saw it.
        bad = infer_request(rows(1))
        bad.inputs[0].name = "nonsense"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(bad, timeout=5)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit of 1 concurrent ModelInfer calls" in (caught.value.details() or "")
        assert len((await first).outputs) == 1
        # Answered calls leave: the next one is admitted again.
        await stub.ModelInfer(infer_request(rows(1)), timeout=5)
    assert servicer.in_flight == 0
    assert servicer.repository.resolve("fraud", "v1").batcher.stats.outcomes["ok"] == 2


async def test_shadowed_calls_are_recorded_by_the_servicer_with_their_role(
    artifacts: dict[int, Artifact], tmp_path: Path
) -> None:
    ledger = ShadowLedger(tmp_path / "shadow.jsonl")
    servicer = InferenceServicer(
        replica=REPLICA, loader=demo_loader(artifacts), shadow=ShadowRecorder(ledger, REPLICA)
    )
    await servicer.repository.load("fraud", "v1")
    async with serving(servicer) as (stub, _):
        marked_call = [("x-request-id", "r-1"), (SHADOW_ROLE_HEADER, "shadow")]
        answer = await stub.ModelInfer(infer_request(rows(2)), metadata=marked_call)
        await stub.ModelInfer(infer_request(rows(1)), metadata=[("x-request-id", "r-2")])
    ledger.close()
    [line] = (tmp_path / "shadow.jsonl").read_text().splitlines()  # the unmarked call: none
    entry = json.loads(line)
    assert (entry["role"], entry["request_id"], entry["version"]) == ("shadow", "r-1", "v1")
    assert entry["scores"] == pytest.approx(scores_of(answer).ravel().tolist())
