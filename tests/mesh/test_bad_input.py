"""Bad requests through the whole mesh: the right status naming the field, and nobody crashes."""

from __future__ import annotations

import grpc
import pytest

from servemesh.launcher import Mesh
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc


def _status(
    gateway: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.PredictRequest
) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        gateway.Predict(request, timeout=5)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize(
    ("request_", "code", "mentions"),
    [
        (
            gateway_pb2.PredictRequest(model="no-such-model", entity_ids=["user-1"]),
            grpc.StatusCode.NOT_FOUND,
            "model",
        ),
        (
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1", "user-does-not-exist"]),
            grpc.StatusCode.NOT_FOUND,
            "user-does-not-exist",
        ),
        (
            gateway_pb2.PredictRequest(
                model="fraud", rows=[gateway_pb2.FeatureRow(values=[0.1] * 63)]
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "rows[0].values",
        ),
        (
            gateway_pb2.PredictRequest(model="fraud", version="v9", entity_ids=["user-1"]),
            grpc.StatusCode.NOT_FOUND,
            "version",
        ),
        (gateway_pb2.PredictRequest(model="fraud"), grpc.StatusCode.INVALID_ARGUMENT, "entity_ids"),
    ],
)
def test_bad_predicts_get_a_clear_status_and_the_mesh_keeps_serving(
    mesh: Mesh,
    gateway: gateway_pb2_grpc.GatewayStub,
    request_: gateway_pb2.PredictRequest,
    code: grpc.StatusCode,
    mentions: str,
) -> None:
    pids = mesh.pids()
    got, details = _status(gateway, request_)
    assert got == code, details
    assert mentions in details
    good = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"]), timeout=5
    )
    assert len(good.scores) == 1
    assert all(child.alive() for child in mesh.children.values())
    assert mesh.pids() == pids


def test_oversized_message_is_resource_exhausted_and_the_gateway_survives(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    limit = mesh.spec.limits.max_message_bytes
    too_many_ids = ["x" * 200] * (limit // 200 + 10)
    code, details = _status(
        gateway, gateway_pb2.PredictRequest(model="fraud", entity_ids=too_many_ids)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    good = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-2"]), timeout=5
    )
    assert len(good.scores) == 1
    assert all(child.alive() for child in mesh.children.values())
