"""Predict validation and model-call building, without a network."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from servemesh.services.gateway.predict import (
    ModelSignature,
    TensorMeta,
    build_infer_request,
    fallback_response,
    plan_predict,
    scores_of,
    split_outputs,
    stale_reason,
    view_inputs,
)
from servemesh.services.runtime.errors import MeshError
from servemesh.spec import MeshSpec, ModelSpec
from servemesh_api.feature.v1 import feature_pb2
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2 as oip

SPEC = MeshSpec()


def _row(n: int, value: float = 0.5) -> gateway_pb2.FeatureRow:
    return gateway_pb2.FeatureRow(values=[value] * n)


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (gateway_pb2.PredictRequest(entity_ids=["u"]), grpc.StatusCode.INVALID_ARGUMENT, "model"),
        (
            gateway_pb2.PredictRequest(model="nope", entity_ids=["u"]),
            grpc.StatusCode.NOT_FOUND,
            "model",
        ),
        (
            gateway_pb2.PredictRequest(model="fraud", version="v9", entity_ids=["u"]),
            grpc.StatusCode.NOT_FOUND,
            "version",
        ),
        (
            gateway_pb2.PredictRequest(model="fraud"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "entity_ids, rows",
        ),
        (
            gateway_pb2.PredictRequest(model="fraud", rows=[_row(64), _row(63)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "rows[1].values",
        ),
        (
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["a", ""]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "entity_ids[1]",
        ),
        (
            gateway_pb2.PredictRequest(model="fraud", rows=[_row(64, float("inf"))]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "rows[0].values[0]",
        ),
        (
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["u"] * 1025),
            grpc.StatusCode.INVALID_ARGUMENT,
            "entity_ids, rows",
        ),
    ],
)
def test_bad_requests_name_the_field(
    request_: gateway_pb2.PredictRequest, code: grpc.StatusCode, field: str
) -> None:
    with pytest.raises(MeshError) as err:
        plan_predict(request_, SPEC)
    assert err.value.code == code
    assert str(err.value).startswith(field)


DEMO_SIGNATURE = ModelSignature(
    inputs=(TensorMeta("features", "FP32", (-1, 64)),),
    outputs=(TensorMeta("score", "FP32", (-1, 1)),),
)


def test_infer_request_carries_rows_as_one_raw_fp32_tensor() -> None:
    plan = plan_predict(gateway_pb2.PredictRequest(model="fraud", rows=[_row(64, 0.25)] * 3), SPEC)
    views = view_inputs(plan, {})
    request = build_infer_request(plan, DEMO_SIGNATURE, views, {}, "rid-1")
    assert request.model_name == "fraud" and request.id == "rid-1"
    assert list(request.inputs[0].shape) == [3, 64] and request.inputs[0].datatype == "FP32"
    decoded = np.frombuffer(request.raw_input_contents[0], dtype="<f4").reshape(3, 64)
    assert np.all(decoded == 0.25)
    assert list(request.outputs) == []  # every output


def test_entity_rows_come_before_the_callers_rows() -> None:
    request = gateway_pb2.PredictRequest(model="fraud", entity_ids=["a", "b"], rows=[_row(64, 9)])
    plan = plan_predict(request, SPEC)
    assert plan.n_rows == 3 and [r.entity_ids for r in plan.reads] == [["a", "b"]]
    looked_up = np.ones((2, 64), dtype=np.float32)
    matrix = view_inputs(plan, {"user": looked_up})["features"]
    assert matrix.shape == (3, 64) and matrix[2, 0] == 9 and matrix[0, 0] == 1


def test_scores_are_read_from_raw_or_typed_outputs_and_checked_for_count() -> None:
    raw = oip.ModelInferResponse(raw_output_contents=[np.array([0.1, 0.9], dtype="<f4").tobytes()])
    raw.outputs.add(name="score", datatype="FP32", shape=[2, 1])
    outputs = split_outputs(raw, [2])[0]
    assert scores_of(outputs, 2) == pytest.approx([0.1, 0.9])
    assert list(outputs["score"].shape) == [2, 1]
    typed = oip.ModelInferResponse()
    typed.outputs.add(name="score", datatype="FP32", shape=[2, 1]).contents.fp32_contents.extend(
        [0.3, 0.4]
    )
    assert scores_of(split_outputs(typed, [2])[0], 2) == pytest.approx([0.3, 0.4])
    with pytest.raises(MeshError) as err:
        split_outputs(typed, [3])
    assert err.value.code == grpc.StatusCode.INTERNAL


def test_fallback_only_when_the_spec_configures_one() -> None:
    plan = plan_predict(gateway_pb2.PredictRequest(model="fraud", entity_ids=["a", "b"]), SPEC)
    assert fallback_response(plan, "rid", "model down") is None
    spec = MeshSpec(models={"fraud": ModelSpec(fallback_score=0.5)})
    plan = plan_predict(gateway_pb2.PredictRequest(model="fraud", entity_ids=["a", "b"]), spec)
    reply = fallback_response(plan, "rid", "model down")
    assert reply is not None and reply.degraded and list(reply.scores) == [0.5, 0.5]
    assert reply.degraded_reason == "model down"


def test_stale_features_name_their_entities_and_fresh_ones_give_no_reason() -> None:
    vectors = [
        feature_pb2.FeatureVector(values=[1.0], stale=stale) for stale in (False, True, True)
    ]
    assert stale_reason(["a", "b", "c"], vectors) == "stale features for b, c"
    assert stale_reason(["a"], vectors[:1]) == ""
    many = [feature_pb2.FeatureVector(stale=True) for _ in range(7)]
    assert stale_reason([f"e{i}" for i in range(7)], many).endswith("e4 and 2 more")
