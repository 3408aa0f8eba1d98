"""One prediction end to end: client -> Envoy edge -> gateway -> Envoy mesh -> feature/model."""

from __future__ import annotations

import io
import time
import uuid

import grpc
import numpy as np
import pytest
import torch

from servemesh.demo import demo_artifact, demo_features
from servemesh.launcher import Mesh
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.mesh.conftest import SLOW_VERSION
from tests.waiting import wait_until


def _torchscript_scores(seed: int, rows: np.ndarray) -> np.ndarray:
    model = torch.jit.load(io.BytesIO(demo_artifact(seed).data))
    with torch.inference_mode():
        return model(torch.from_numpy(rows)).numpy().reshape(-1)


def test_predict_through_the_mesh_equals_the_torchscript_model(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    features = demo_features(mesh.spec.demo.entities)
    entities = ["user-42", "user-7", "user-499"]
    reply = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=entities), timeout=5
    )
    expected = _torchscript_scores(1, np.stack([features[e] for e in entities]))
    assert reply.model_version == "v1"
    assert np.allclose(reply.scores, expected, rtol=1e-5, atol=1e-6)
    assert reply.request_id and not reply.degraded


def test_pinned_version_answers_with_that_version(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    row = demo_features(1)["user-0"]
    reply = gateway.Predict(
        gateway_pb2.PredictRequest(
            model="fraud", version="v2", rows=[gateway_pb2.FeatureRow(values=row.tolist())]
        ),
        timeout=5,
    )
    assert reply.model_version == "v2"
    assert reply.scores[0] == pytest.approx(
        float(_torchscript_scores(2, row[None, :])[0]), rel=1e-5
    )


def test_callers_request_id_follows_the_request_to_the_model_replica(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    request_id = f"trace-{uuid.uuid4().hex}"
    reply = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"]),
        timeout=5,
        metadata=[("x-request-id", request_id)],
    )
    assert reply.request_id == request_id
    gateway_logs = "".join(p.read_text() for p in mesh.logs_dir.glob("gateway-*.log"))
    assert request_id in gateway_logs


def _rows_computed(mesh: Mesh, version: str) -> int:
    """Rows every model replica has run through `version` (OIP statistics, inference_count)."""
    total = 0
    for inst in mesh.spec.instances():
        if inst.service != "model":
            continue
        with grpc.insecure_channel(mesh.spec.address_of(inst.name)) as channel:
            stats = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                oip.ModelStatisticsRequest(name="fraud", version=version), timeout=2
            )
        total += sum(s.inference_count for s in stats.model_stats)
    return total


def test_deadline_shorter_than_the_model_is_deadline_exceeded_and_the_replica_drops_it(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    request_id = f"late-{uuid.uuid4().hex}"
    computed_before = _rows_computed(mesh, SLOW_VERSION)
    started = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        gateway.Predict(
            gateway_pb2.PredictRequest(model="fraud", version=SLOW_VERSION, entity_ids=["user-3"]),
            timeout=0.050,
            metadata=[("x-request-id", request_id)],
        )
    elapsed_ms = (time.perf_counter() - started) * 1000
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed_ms < 60 + 20, (
        f"answered after {elapsed_ms:.0f} ms"
    )  # 20 ms slack for a 2-core box

    # The replica refused to run it rather than computing a late answer (it knows a batch
    # takes ~200 ms); the line may land a moment after the client gave up.
    def dropped() -> bool:
        return any(
            request_id in line and "dropped" in line
            for path in mesh.logs_dir.glob("model-*.log")
            for line in path.read_text().splitlines()
        )

    wait_until(dropped, f"a replica to log dropping {request_id}")
    assert _rows_computed(mesh, SLOW_VERSION) == computed_before


def test_a_request_with_time_to_spare_still_gets_the_slow_model(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    computed_before = _rows_computed(mesh, SLOW_VERSION)
    reply = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", version=SLOW_VERSION, entity_ids=["user-3"]),
        timeout=3,
    )
    assert reply.model_version == SLOW_VERSION
    assert _rows_computed(mesh, SLOW_VERSION) == computed_before + 1
