"""Prometheus metrics of a model server: scraped over HTTP from its side port."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servemesh.contract.demo import Artifact
from servemesh.services.model.app import build_server
from servemesh.services.model.loader import ModelLoader
from servemesh.spec import (
    BatchingSpec,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    ResolvedSpec,
    SpecError,
    resolve,
)
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.model.model_helpers import GatedLoader, rows
from tests.model.test_model_server import demo_loader, infer_request

INSTANCE = "model-fraud-zone-a-0"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def mesh_spec(tmp_path: Path, batching: BatchingSpec) -> ResolvedSpec:
    return resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(tmp_path),
            models={
                "fraud": ModelSpec(
                    versions={"v1": ModelVersionSpec(source="demo:1")},
                    traffic={"v1": 100},
                    batching=batching,
                )
            },
        )
    )


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model": "fraud", "version": "v1", **labels}.items())))
    return samples[key]


@asynccontextmanager
async def model_server(
    spec: ResolvedSpec, loader: ModelLoader
) -> AsyncIterator[grpc_service_pb2_grpc.GRPCInferenceServiceStub]:
    server = await build_server(spec, INSTANCE, loader=loader, tls=False)
    await server.start()
    channel = grpc.aio.insecure_channel(spec.address_of(INSTANCE))
    try:
        yield grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await channel.close()
        await server.drain()


def test_every_instance_gets_its_own_metrics_port() -> None:
    spec = resolve(MeshSpec(ports=Ports.free()))
    models = [i.name for i in spec.instances() if i.service == "model"]
    assert sorted(spec.metrics_ports) == sorted(i.name for i in spec.instances())
    ports = [*spec.instance_ports.values(), *spec.metrics_ports.values()]
    assert 0 not in ports and len(set(ports)) == len(ports)
    assert spec.metrics_address_of(models[0]) == f"127.0.0.1:{spec.metrics_ports[models[0]]}"
    # A resolved spec keeps its ports when resolved again.
    assert resolve(spec).metrics_ports == spec.metrics_ports
    with pytest.raises(SpecError, match="no instance named 'gateway-zone-c-0'"):
        spec.metrics_address_of("gateway-zone-c-0")
    assert not hasattr(MeshSpec(), "metrics_address_of")  # a declared spec has no ports


async def test_metrics_follow_the_requests_served(
    tmp_path: Path, artifacts: dict[int, Artifact]
) -> None:
    batching = BatchingSpec(max_batch_size=16, max_queue_delay_ms=30, dispatch="fixed_window")
    spec = mesh_spec(tmp_path, batching)
    loader = GatedLoader(artifacts, batching)
    async with model_server(spec, loader) as stub:
        before = scrape(spec.metrics_address_of(INSTANCE))
        assert value(before, "servemesh_model_requests_total", outcome="ok") == 0
        requests = [rows(1 + i % 3, seed=i) for i in range(12)]
        calls = [
            asyncio.ensure_future(stub.ModelInfer(infer_request(r), timeout=5)) for r in requests
        ]
        for _ in requests:  # all queued (or in the held first batch) before the model runs
            await loader.batchers["v1"].admitted.get()
        loader.models["v1"].open()
        await asyncio.gather(*calls)
        after = scrape(spec.metrics_address_of(INSTANCE))
    rows_sent = float(sum(len(r) for r in requests))
    executions = value(after, "servemesh_model_executions_total")
    assert value(after, "servemesh_model_requests_total", outcome="ok") == 12
    assert value(after, "servemesh_model_inferences_total") == rows_sent
    assert 1 <= executions <= 3  # batched: the held batch, then the rest 16 rows at a time
    # Triton's convention and the histogram agree on the mean batch size.
    assert value(after, "servemesh_model_batch_size_count") == executions
    assert value(after, "servemesh_model_batch_size_sum") == rows_sent
    assert value(after, "servemesh_model_batch_size_bucket", le="+Inf") == executions
    assert value(after, "servemesh_model_queue_wait_seconds_count") == 12
    assert value(after, "servemesh_model_compute_seconds_count") == executions
    assert value(after, "servemesh_model_queue_depth") == 0
    assert value(after, "servemesh_model_expired_computed_total") == 0


async def test_shed_and_refused_requests_are_counted_by_outcome(
    tmp_path: Path, artifacts: dict[int, Artifact]
) -> None:
    batching = BatchingSpec(
        max_batch_size=1, max_queue_delay_ms=0, max_queue_size=1, dispatch="fixed_window"
    )
    spec = mesh_spec(tmp_path, batching)
    # Each batch takes at least 100 ms (injected), and the model's expected time says so.
    loader = GatedLoader(artifacts, batching, inject_latency_ms=100)
    async with model_server(spec, loader) as stub:
        model = loader.models["v1"]
        running = asyncio.ensure_future(stub.ModelInfer(infer_request(rows(1)), timeout=5))
        await model.entered()  # in the model now; the queue (bound 1) is empty
        calls = [
            asyncio.ensure_future(stub.ModelInfer(infer_request(rows(1)), timeout=5))
            for _ in range(2)
        ]
        # One takes the queue's only place and waits; the other is shed at once.
        await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
        model.open()
        outcomes = await asyncio.gather(running, *calls, return_exceptions=True)
        codes = sorted(
            o.code().name if isinstance(o, grpc.aio.AioRpcError) else "OK" for o in outcomes
        )
        assert codes == ["OK", "OK", "RESOURCE_EXHAUSTED"]  # one running, one queued, one shed
        refused = infer_request(rows(1))
        refused.parameters["timeout"].int64_param = 50_000  # 50 ms for a 100 ms model
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ModelInfer(refused, timeout=5)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        samples = scrape(spec.metrics_address_of(INSTANCE))
    assert value(samples, "servemesh_model_requests_total", outcome="ok") == 2
    assert value(samples, "servemesh_model_requests_total", outcome="shed") == 1
    assert value(samples, "servemesh_model_requests_total", outcome="refused") == 1
    assert value(samples, "servemesh_model_executions_total") == 2


async def test_two_servers_in_one_process_keep_separate_metrics(
    tmp_path: Path, artifacts: dict[int, Artifact]
) -> None:
    batching = BatchingSpec()
    first, second = mesh_spec(tmp_path / "a", batching), mesh_spec(tmp_path / "b", batching)
    loader = demo_loader(artifacts)
    async with model_server(first, loader) as stub_a, model_server(second, loader):
        await stub_a.ModelInfer(infer_request(rows(1)), timeout=5)
        served = scrape(first.metrics_address_of(INSTANCE))
        idle = scrape(second.metrics_address_of(INSTANCE))
    assert value(served, "servemesh_model_requests_total", outcome="ok") == 1
    assert value(idle, "servemesh_model_requests_total", outcome="ok") == 0
