"""Planning a call to a model that lists its inputs: entities per view, raw inputs, outputs."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from servemesh.services.gateway.predict import (
    ModelSignature,
    TensorMeta,
    build_infer_request,
    conform_inputs,
    fallback_response,
    plan_predict,
    scores_of,
    signature_from_metadata,
    split_outputs,
    view_inputs,
)
from servemesh.services.runtime.errors import MeshError
from servemesh.spec import parse_spec
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2 as oip

SPEC = parse_spec(
    """
feature_views:
  lot: {features: [alcohol, malic_acid, ash]}
  cellar: {entity: lot, features: [humidity, temperature]}
  merchant: {features: [rating, volume]}
  user: {}
models:
  fraud: {}
  wine:
    inputs:
      chemistry: {view: lot, features: [ash, alcohol]}
      storage: {view: cellar, features: [temperature]}
      seller: {view: merchant, features: [volume, rating]}
      tasting: {raw: true}
    versions: {v1: {}}
    traffic: {v1: 100}
    fallback_score: 0.5
  echo:
    inputs:
      a: {raw: true}
      b: {raw: true}
    versions: {v1: {}}
    traffic: {v1: 100}
"""
)

WINE = ModelSignature(
    inputs=(
        TensorMeta("chemistry", "FP64", (-1, 2)),
        TensorMeta("storage", "FP16", (-1, 1)),
        TensorMeta("seller", "FP32", (-1, 2)),
        TensorMeta("tasting", "FP32", (-1, 3)),
    ),
    outputs=(
        TensorMeta("probabilities", "FP32", (-1, 3)),
        TensorMeta("label", "INT64", (-1,)),
    ),
)


def _row(**ids: str) -> gateway_pb2.EntityRow:
    return gateway_pb2.EntityRow(ids=ids)


def _floats(rows: list[list[float]], datatype: str = "") -> gateway_pb2.Tensor:
    flat = [v for row in rows for v in row]
    return gateway_pb2.Tensor(datatype=datatype, shape=[len(rows), len(rows[0])], float_values=flat)


def wine_request(**changes: object) -> gateway_pb2.PredictRequest:
    request = gateway_pb2.PredictRequest(
        model="wine",
        entities=[_row(lot="L-1", merchant="m-1"), _row(lot="L-2", merchant="m-2")],
    )
    request.inputs["tasting"].CopyFrom(_floats([[1, 2, 3], [4, 5, 6]]))
    for name, value in changes.items():
        if name == "inputs":
            request.ClearField("inputs")
            for key, tensor in value.items():  # type: ignore[attr-defined]
                request.inputs[key].CopyFrom(tensor)
        else:
            request.ClearField(name)
            getattr(request, name).extend(value)
    return request


def test_one_read_per_view_keyed_by_its_entity_with_the_features_its_inputs_need() -> None:
    plan = plan_predict(wine_request(), SPEC)
    reads = {r.view: (r.entity, r.entity_ids, r.features) for r in plan.reads}
    assert reads == {
        "lot": ("lot", ["L-1", "L-2"], ["ash", "alcohol"]),
        "cellar": ("lot", ["L-1", "L-2"], ["temperature"]),
        "merchant": ("merchant", ["m-1", "m-2"], ["volume", "rating"]),
    }
    assert plan.n_rows == 2 and list(plan.raw) == ["tasting"]


def test_every_input_reaches_the_model_in_the_datatype_it_takes() -> None:
    plan = plan_predict(wine_request(), SPEC)
    matrices = {
        "lot": np.array([[0.5, 13.0], [0.25, 12.0]], dtype=np.float32),
        "cellar": np.array([[11.5], [12.5]], dtype=np.float32),
        "merchant": np.array([[100, 4], [200, 5]], dtype=np.float32),
    }
    request = build_infer_request(
        plan, WINE, view_inputs(plan, matrices), conform_inputs(plan, WINE), "rid"
    )
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
        ("chemistry", "FP64", [2, 2]),
        ("storage", "FP16", [2, 1]),
        ("seller", "FP32", [2, 2]),
        ("tasting", "FP32", [2, 3]),
    ]
    raw = request.raw_input_contents
    assert np.frombuffer(raw[0], "<f8").tolist() == [0.5, 13.0, 0.25, 12.0]
    assert np.frombuffer(raw[1], "<f2").tolist() == [11.5, 12.5]
    assert np.frombuffer(raw[3], "<f4").tolist() == [1, 2, 3, 4, 5, 6]
    assert list(request.outputs) == []


def test_a_model_of_raw_inputs_alone_takes_its_rows_from_them() -> None:
    request = gateway_pb2.PredictRequest(model="echo")
    request.inputs["a"].CopyFrom(_floats([[1.0], [2.0], [3.0]]))
    request.inputs["b"].CopyFrom(
        gateway_pb2.Tensor(datatype="INT64", shape=[3], int64_values=[1, 2, 3])
    )
    plan = plan_predict(request, SPEC)
    assert plan.n_rows == 3 and plan.reads == []


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (wine_request(rows=[gateway_pb2.FeatureRow(values=[1.0])]), "rows"),
        (wine_request(entity_ids=["L-1"], entities=[]), "entity_ids"),
        (wine_request(entity_ids=["L-1"]), "entities: give entity_ids or entities"),
        (wine_request(entities=[]), "entities: model 'wine' reads entities ['lot', 'merchant']"),
        (wine_request(entities=[_row(lot="L-1")]), "entities[0]: names no id for entity"),
        (
            wine_request(entities=[_row(lot="L-1", merchant="m", user="u")]),
            "entities[0]: unknown entity 'user'",
        ),
        (wine_request(entities=[_row(lot="", merchant="m")]), "entities[0].ids['lot']"),
        (wine_request(inputs={}), "inputs['tasting']: required"),
        (
            wine_request(inputs={"tasting": _floats([[1, 2, 3]] * 2), "nope": _floats([[1]])}),
            "inputs['nope']: model 'wine' has no input",
        ),
        (
            wine_request(inputs={"tasting": _floats([[1, 2, 3]] * 2), "chemistry": _floats([[1]])}),
            "inputs['chemistry']: filled from feature view 'lot'",
        ),
        (
            wine_request(inputs={"tasting": _floats([[1, 2, 3]])}),
            "inputs['tasting'].shape[0]: 1 rows, but entities names 2",
        ),
        (
            wine_request(inputs={"tasting": _floats([[1, 2, float("nan")]] * 2)}),
            "inputs['tasting'].float_values[2]: not a finite number",
        ),
        (
            wine_request(
                inputs={"tasting": gateway_pb2.Tensor(shape=[2, 3], float_values=[1.0] * 5)}
            ),
            "inputs['tasting'].float_values: shape [2, 3] holds 6 values, got 5",
        ),
        (
            wine_request(inputs={"tasting": gateway_pb2.Tensor(float_values=[1.0])}),
            "inputs['tasting'].shape: required",
        ),
        (
            wine_request(entities=[_row(lot="L", merchant="m")] * 1025),
            "entities: 1025 rows, at most 1024",
        ),
        (gateway_pb2.PredictRequest(model="echo", entity_ids=["x"]), "entity_ids: model 'echo'"),
        (
            gateway_pb2.PredictRequest(model="echo", entities=[_row(lot="x")]),
            "entities: model 'echo' reads no feature view",
        ),
        (
            gateway_pb2.PredictRequest(model="fraud", inputs={"features": _floats([[1.0] * 64])}),
            "inputs['features']: model 'fraud' takes no raw inputs",
        ),
    ],
)
def test_bad_requests_name_the_field(request_: gateway_pb2.PredictRequest, field: str) -> None:
    with pytest.raises(MeshError) as err:
        plan_predict(request_, SPEC)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value).startswith(field), str(err.value)


def test_raw_inputs_of_different_row_counts_are_refused() -> None:
    request = gateway_pb2.PredictRequest(model="echo")
    request.inputs["a"].CopyFrom(_floats([[1.0], [2.0]]))
    request.inputs["b"].CopyFrom(_floats([[1.0]]))
    with pytest.raises(MeshError, match=r"inputs\['b'\].shape\[0\]: 1 rows, but inputs\['a'\]"):
        plan_predict(request, SPEC)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            _floats([[1, 2]] * 2),
            r"inputs\['tasting'\].shape: model 'wine' takes \[-1, 3\] \(3 values per row\)",
        ),
        (
            gateway_pb2.Tensor(datatype="FP64", shape=[2, 3], double_values=[1.0] * 6),
            r"inputs\['tasting'\].datatype: model 'wine' takes FP32, got FP64",
        ),
        (
            gateway_pb2.Tensor(datatype="INT64", shape=[2, 3], int64_values=[1] * 6),
            r"inputs\['tasting'\].datatype: model 'wine' takes FP32, got INT64",
        ),
    ],
)
def test_raw_inputs_must_fit_the_models_signature(tensor: gateway_pb2.Tensor, message: str) -> None:
    plan = plan_predict(wine_request(inputs={"tasting": tensor}), SPEC)
    with pytest.raises(MeshError, match=message) as err:
        conform_inputs(plan, WINE)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_flat_row_fits_a_model_input_of_more_dims() -> None:
    signature = ModelSignature(
        inputs=(*WINE.inputs[:3], TensorMeta("tasting", "FP32", (-1, 3, 1))),
        outputs=WINE.outputs,
    )
    plan = plan_predict(wine_request(), SPEC)
    assert conform_inputs(plan, signature)["tasting"].shape == (2, 3, 1)


def test_every_output_comes_back_named_and_scores_only_for_one_number_per_row() -> None:
    reply = oip.ModelInferResponse(
        raw_output_contents=[
            np.array([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]], dtype="<f4").tobytes(),
            np.array([2, 0], dtype="<i8").tobytes(),
        ]
    )
    reply.outputs.add(name="probabilities", datatype="FP32", shape=[2, 3])
    reply.outputs.add(name="label", datatype="INT64", shape=[2])
    outputs = split_outputs(reply, [2])[0]
    assert list(outputs["label"].int64_values) == [2, 0]
    assert list(outputs["probabilities"].shape) == [2, 3]
    assert outputs["probabilities"].float_values[2] == pytest.approx(0.5)
    assert scores_of(outputs, 2) == []
    assert scores_of({"label": outputs["label"]}, 2) == [2.0, 0.0]


def test_a_signature_the_spec_does_not_fit_is_a_failed_precondition() -> None:
    metadata = oip.ModelMetadataResponse(name="wine")
    for meta in WINE.inputs[:3]:
        metadata.inputs.add(name=meta.name, datatype=meta.datatype, shape=list(meta.shape))
    metadata.inputs.add(name="tasting", datatype="FP32", shape=[-1, 3])
    metadata.inputs.add(name="extra", datatype="FP32", shape=[-1, 3])
    metadata.outputs.add(name="label", datatype="INT64", shape=[-1])
    with pytest.raises(MeshError, match="input 'extra' is not mapped") as err:
        signature_from_metadata("wine", SPEC.models["wine"], metadata)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    del metadata.inputs[-1]
    assert signature_from_metadata("wine", SPEC.models["wine"], metadata).input_named("tasting")


def test_a_fallback_answers_one_score_per_row() -> None:
    reply = fallback_response(plan_predict(wine_request(), SPEC), "rid", "down")
    assert reply is not None and list(reply.scores) == [0.5, 0.5] and reply.degraded
