"""What a watch captures of a call, and the row the writer makes of it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from servemesh.predlog.features import (
    HASH_HEX,
    HOLD_BYTES,
    feature_columns,
    feature_hash,
    features_json,
)
from servemesh.predlog.record import (
    COLUMNS,
    PredictWatch,
    RowContext,
    to_row,
    trace_id_of,
)
from servemesh.services.runtime.errors import InvalidArgument, NotFound
from servemesh.spec import ModelInputSpec
from servemesh_api.gateway.v1 import gateway_pb2
from tests.predlog.records import CONTEXT, LOGGED, TYPES, Meta, answer, captured, vector

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
NOW = 1_800_000_000.0


def _watch(request: gateway_pb2.PredictRequest, sink: list[PredictWatch]) -> PredictWatch:
    metadata = (("traceparent", f"00-{TRACE}-00f067aa0ba902b7-01"), ("x-request-id", "r-1"))
    return PredictWatch(sink.append, 64, request, "r-1", metadata)


def _as_dict(c: PredictWatch, ctx: RowContext = CONTEXT) -> dict[str, object]:
    return dict(zip(COLUMNS, to_row(c, ctx), strict=True))


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"00-{TRACE}-00f067aa0ba902b7-01", TRACE),
        (f"00-{TRACE.upper()}-00f067aa0ba902b7-01".encode(), TRACE),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", ""),  # all zeros: invalid by W3C
        ("garbage", ""),
    ],
)
def test_the_trace_id_comes_from_a_valid_traceparent_only(
    header: str | bytes, expected: str
) -> None:
    assert trace_id_of([("x-request-id", "r"), ("traceparent", header)]) == expected
    assert trace_id_of([("x-request-id", "r")]) == ""


async def test_an_answer_becomes_a_row_with_its_replica_zone_outputs_and_timings() -> None:
    sink: list[PredictWatch] = []
    watch = _watch(gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-42"]), sink)
    await watch.features(asyncio.sleep(0))
    await watch.inference(asyncio.sleep(0))
    assert watch.answered(answer(0.638087)) is not None
    (record,) = sink
    row = _as_dict(record)
    assert row["request_id"] == "r-1" and row["trace_id"] == TRACE
    assert (row["gateway"], row["gateway_zone"]) == ("gateway-zone-a-0", "zone-a")
    assert (row["model"], row["version"]) == ("fraud", "v1")
    assert (row["replica"], row["zone"]) == ("model-fraud-zone-a-0", "zone-a")
    assert json.loads(str(row["entities"])) == {"user": ["user-42"]}
    assert row["entity_keys"] == ["user=user-42"]
    assert json.loads(str(row["outputs"])) == {"score": [[0.638087]]}
    assert row["status"] == "OK" and row["message"] == "" and row["degraded"] is False
    feature_ms, inference_ms, total_ms = row["feature_ms"], row["inference_ms"], row["total_ms"]
    assert isinstance(feature_ms, float) and isinstance(inference_ms, float)
    assert isinstance(total_ms, float) and 0 <= feature_ms + inference_ms <= total_ms


async def test_a_failed_call_keeps_its_status_and_the_time_of_the_part_that_failed() -> None:
    sink: list[PredictWatch] = []
    watch = _watch(gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-x"]), sink)

    async def missing() -> None:
        raise NotFound("entity 'user-x' has no features")

    with pytest.raises(NotFound):
        await watch.features(missing())
    watch.failed(NotFound("entity 'user-x' has no features"))
    row = _as_dict(sink[0])
    assert row["status"] == "NOT_FOUND" and "user-x" in str(row["message"])
    assert row["feature_ms"] is not None and row["inference_ms"] is None
    assert row["replica"] == "" and row["outputs"] == "{}"


def test_a_refused_request_names_its_entities_and_a_bounded_message() -> None:
    sink: list[PredictWatch] = []
    request = gateway_pb2.PredictRequest(
        model="wine", entities=[gateway_pb2.EntityRow(ids={"lot": "L-3", "seller": "m-2"})]
    )
    _watch(request, sink).failed(InvalidArgument("rows[0].values: " + "x" * 5000))
    row = _as_dict(sink[0], RowContext("g", "z", max_message_chars=100))
    assert row["status"] == "INVALID_ARGUMENT"
    assert str(row["message"]).startswith("rows[0].values") and len(str(row["message"])) == 100
    assert json.loads(str(row["entities"])) == {"lot": ["L-3"], "seller": ["m-2"]}
    assert sorted(row["entity_keys"]) == ["lot=L-3", "seller=m-2"]  # type: ignore[call-overload]


def test_other_exceptions_and_cancellation_get_the_status_the_caller_sees() -> None:
    sink: list[PredictWatch] = []
    request = gateway_pb2.PredictRequest(model="fraud")
    _watch(request, sink).failed(ValueError("boom"))
    _watch(request, sink).failed(asyncio.CancelledError())
    assert [c.status for c in sink] == ["INTERNAL", "CANCELLED"]
    assert sink[0].message == "ValueError: boom"


def test_large_outputs_and_many_entities_stay_within_their_bounds() -> None:
    sink: list[PredictWatch] = []
    ids = [f"user-{i}" for i in range(1000)]
    watch = _watch(gateway_pb2.PredictRequest(model="fraud", entity_ids=ids), sink)
    big = gateway_pb2.PredictResponse(
        model_version="v1",
        outputs={
            "probabilities": gateway_pb2.Tensor(
                datatype="FP32", shape=[1000, 3], float_values=[0.1] * 3000
            )
        },
    )
    watch.answered(big)
    row = _as_dict(sink[0], RowContext("g", "z", max_output_bytes=512, max_entity_ids=10))
    outputs = json.loads(str(row["outputs"]))
    assert len(str(row["outputs"])) <= 512
    assert outputs["probabilities"]["shape"] == [1000, 3] and outputs["probabilities"]["head"]
    assert json.loads(str(row["entities"])) == {"entity": ids[:10]}  # the model is unknown here
    # The request path capped the ids it copied: no 1,000-id lists wait in the buffer.
    assert len(sink[0].entity_ids) == 64


def test_a_call_is_recorded_once() -> None:
    sink: list[PredictWatch] = []
    watch = _watch(gateway_pb2.PredictRequest(model="fraud"), sink)
    watch.answered(answer())
    watch.failed(ValueError("late"))
    assert len(sink) == 1 and sink[0].status == "OK"


def _logged(
    inputs: dict[str, np.ndarray], ctx: RowContext = LOGGED, **kwargs: Any
) -> dict[str, Any]:
    return dict(zip(COLUMNS, to_row(captured(NOW, inputs=inputs, **kwargs), ctx), strict=True))


def test_every_record_keeps_the_vector_s_hash_and_count_and_values_only_when_logged() -> None:
    rows = vector([0.5, -1.25, 3.0], [1.0, 2.0, 1e-8])
    kept = _logged(rows)
    private = _logged(rows, CONTEXT)
    assert kept["feature_count"] == private["feature_count"] == 6
    assert kept["feature_hash"] == private["feature_hash"]
    assert len(kept["feature_hash"]) == HASH_HEX and int(kept["feature_hash"], 16) >= 0
    assert json.loads(kept["features"]) == {
        "f00": [0.5, 1.0],
        "f01": [-1.25, 2.0],
        "f02": [3.0, 1e-8],
    }
    # A model without log_features keeps no values, whatever it sent.
    assert private["features"] is None
    # One value moved: another hash; the same values again, the same hash.
    moved = _logged(vector([0.5, -1.25, 3.0], [1.0, 2.0, 2e-8]))
    assert moved["feature_hash"] != kept["feature_hash"]
    assert (
        _logged(vector([0.5, -1.25, 3.0], [1.0, 2.0, 1e-8]))["feature_hash"] == kept["feature_hash"]
    )


def test_a_call_that_never_reached_the_model_has_no_vector() -> None:
    row = dict(zip(COLUMNS, to_row(captured(NOW, status="NOT_FOUND"), LOGGED), strict=True))
    assert (row["feature_hash"], row["feature_count"], row["features"]) == ("", 0, None)


def test_the_values_keep_whole_rows_within_the_cap() -> None:
    rows = vector(*([0.125, 0.25, 0.5] for _ in range(100)))
    capped = _logged(rows, replace(LOGGED, max_feature_bytes=256))
    values = json.loads(capped["features"])
    assert len(capped["features"]) <= 256
    kept = {len(v) for v in values.values()}
    assert len(kept) == 1 and 1 < kept.pop() < 100  # whole rows, as many as fit
    assert capped["feature_count"] == 300  # the count is the whole vector's


def test_a_vector_too_large_to_hold_is_hashed_at_once_and_keeps_no_values() -> None:
    wide = vector(*([1.0, 2.0, 3.0] for _ in range(HOLD_BYTES // 12 + 1)))
    sink: list[PredictWatch] = []
    watch = _watch(gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-42"]), sink)
    watch.model_inputs(TYPES, wide)
    assert watch.inputs is None and watch.feature_count == wide["features"].size
    watch.answered(answer())
    row = _as_dict(sink[0], LOGGED)
    assert row["feature_hash"] == feature_hash(TYPES, wide)[0] and row["features"] is None


def test_columns_are_named_by_feature_and_by_raw_tensor() -> None:
    inputs = {
        "profile": ModelInputSpec(view="user", features=["age", "spend"]),
        "history": ModelInputSpec(view="merchant", features=["spend"]),
        "tasting": ModelInputSpec(raw=True),
        "category": ModelInputSpec(raw=True),
    }
    names = [
        c.name
        for c in feature_columns(inputs, {"profile": 2, "history": 1, "tasting": 3, "category": 1})
    ]
    # `spend` of two views is two features, qualified by view; a raw tensor's columns by
    # its name, indexed when a row holds several.
    assert names == [
        "age",
        "user.spend",
        "merchant.spend",
        "tasting[0]",
        "tasting[1]",
        "tasting[2]",
        "category",
    ]
    text = features_json(
        inputs,
        [Meta("category", "INT64"), Meta("flag", "BOOL")],
        {
            "category": np.array([3, 4], dtype=np.int64),
            "flag": np.array([[True], [False]]),
        },
        4096,
    )
    assert json.loads(text) == {"category": [3, 4], "flag": [True, False]}
