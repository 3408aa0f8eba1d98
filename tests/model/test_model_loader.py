"""Loading from the registry: signature and spec checks, integrity, retries (registry faked)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import torch

from servemesh.contract.demo import DEMO_FEATURES, Artifact
from servemesh.services.model.errors import LoadError
from servemesh.services.model.loader import registry_loader
from servemesh.spec import BatchingSpec, MeshSpec, ModelSpec, ModelVersionSpec
from servemesh_api.registry.v1 import registry_pb2

CHANNEL: Any = object()  # never used: the fake fetch ignores it


def record(
    artifact: Artifact, version: str = "v1", features: int = 64
) -> registry_pb2.ModelVersion:
    return registry_pb2.ModelVersion(
        model="fraud",
        version=version,
        sha256=artifact.sha256,
        size_bytes=artifact.size,
        format="torchscript",
        inputs=[registry_pb2.TensorSpec(name="features", datatype="FP32", shape=[-1, features])],
        outputs=[registry_pb2.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])],
    )


class FakeRegistry:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    async def __call__(self, channel: Any, model: str, version: str, **kwargs: Any) -> Any:
        self.calls.append((model, version, kwargs))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def spec_with(**model: Any) -> MeshSpec:
    versions = {"v1": ModelVersionSpec(source="demo:1", inject_latency_ms=model.pop("inject", 0.0))}
    fraud = ModelSpec(versions=versions, traffic={"v1": 100}, **model)
    return MeshSpec(models={"fraud": fraud})


async def test_registry_version_loads_with_the_specs_batching_and_drill_latency(
    artifacts: dict[int, Artifact],
) -> None:
    batching = BatchingSpec(max_batch_size=8, max_queue_delay_ms=1)
    spec = spec_with(batching=batching, inject=5.0)
    fetch = FakeRegistry([(record(artifacts[1]), artifacts[1].data)])
    loaded = await registry_loader(CHANNEL, spec, fetch=fetch)("fraud", "v1")
    assert (loaded.model, loaded.version, loaded.sha256) == ("fraud", "v1", artifacts[1].sha256)
    assert loaded.batching == batching and loaded.runner.inject_latency_s == 0.005
    assert loaded.signature.input.dims == (64,)
    assert sorted(loaded.batcher.latency.snapshot()) == [1, 8]  # warmed up at 1 and the max
    assert fetch.calls[0][2]["max_bytes"] == spec.limits.max_artifact_bytes
    await loaded.close()


async def test_bytes_that_do_not_match_the_record_never_reach_torch(
    artifacts: dict[int, Artifact], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: pytest.fail("loaded unverified bytes"))
    tampered = bytearray(artifacts[1].data)
    tampered[100] ^= 0x01
    fetch = FakeRegistry([(record(artifacts[1]), bytes(tampered))])
    with pytest.raises(LoadError) as caught:
        await registry_loader(CHANNEL, spec_with(), fetch=fetch)("fraud", "v1")
    assert caught.value.code == grpc.StatusCode.DATA_LOSS
    assert "sha256" in caught.value.message


async def test_signature_that_disagrees_with_the_spec_features_is_refused(
    artifacts: dict[int, Artifact],
) -> None:
    fetch = FakeRegistry([(record(artifacts[1], features=63), artifacts[1].data)])
    with pytest.raises(LoadError, match=r"shape \[-1, 63\] but the spec lists 64 features"):
        await registry_loader(CHANNEL, spec_with(features=list(DEMO_FEATURES)), fetch=fetch)(
            "fraud", "v1"
        )


async def test_unavailable_registry_is_retried_then_other_errors_fail_the_load(
    artifacts: dict[int, Artifact],
) -> None:
    def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(
            code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name
        )

    fetch = FakeRegistry(
        [rpc_error(grpc.StatusCode.UNAVAILABLE), (record(artifacts[1]), artifacts[1].data)]
    )
    loaded = await registry_loader(CHANNEL, spec_with(), fetch=fetch)("fraud", "v1")
    assert len(fetch.calls) == 2
    await loaded.close()
    fetch = FakeRegistry([rpc_error(grpc.StatusCode.NOT_FOUND)])
    with pytest.raises(LoadError) as caught:
        await registry_loader(CHANNEL, spec_with(), fetch=fetch)("fraud", "v9")
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert "model 'fraud' version 'v9'" in caught.value.message
