"""OIP v2 request validation and decoding: every malformed request is refused, naming its field."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from types import SimpleNamespace
from typing import cast

import grpc
import numpy as np
import pytest

from servemesh.contract.wire import REPLICA_PARAMETER, ZONE_PARAMETER
from servemesh.services.model.inference import _plain_answer
from servemesh.services.model.loader import LoadedModel
from servemesh.services.model.tensors import (
    RequestError,
    Signature,
    TensorSig,
    decode_request,
    encode_outputs,
)
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.registry.v1 import registry_pb2
from tests.model.model_helpers import FEATURES, SIGNATURE, array_of, rows

MAX_ROWS = 8
Request = oip.ModelInferRequest


def raw_request(batch: np.ndarray, shape: list[int] | None = None) -> Request:
    request = Request(model_name="fraud")
    request.inputs.add(name="features", datatype="FP32", shape=shape or list(batch.shape))
    request.raw_input_contents.append(batch.astype("<f4").tobytes())
    return request


def typed_request(batch: np.ndarray) -> Request:
    request = Request(model_name="fraud")
    tensor = request.inputs.add(name="features", datatype="FP32", shape=list(batch.shape))
    tensor.contents.fp32_contents.extend(batch.ravel().tolist())
    return request


def refused(request: Request, max_rows: int = MAX_ROWS, signature: Signature = SIGNATURE) -> str:
    with pytest.raises(RequestError) as caught:
        decode_request(request, signature, max_rows)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.message


def test_raw_input_decodes_without_copying() -> None:
    batch = rows(3)
    request = raw_request(batch)
    decoded = decode_request(request, SIGNATURE, MAX_ROWS)
    decoded_rows = array_of(decoded.rows)
    np.testing.assert_array_equal(decoded_rows, batch)
    assert decoded_rows.dtype == np.dtype("<f4") and decoded_rows.shape == (3, FEATURES)
    assert not decoded_rows.flags.owndata  # a view over the request's bytes
    assert decoded.raw and decoded.outputs == ("score",)


def test_typed_input_decodes_to_the_same_rows() -> None:
    batch = rows(2)
    decoded = decode_request(typed_request(batch), SIGNATURE, MAX_ROWS)
    np.testing.assert_array_equal(decoded.rows, batch)
    assert not decoded.raw


def _set_shape(shape: list[int]) -> Callable[[Request], None]:
    def mutate(request: Request) -> None:
        del request.inputs[0].shape[:]
        request.inputs[0].shape.extend(shape)

    return mutate


def _add_input(name: str) -> Callable[[Request], None]:
    def mutate(request: Request) -> None:
        request.inputs.add(name=name, datatype="FP32", shape=[2, FEATURES])
        request.raw_input_contents.append(rows(2).tobytes())

    return mutate


def _set(attr: str, value: object) -> Callable[[Request], None]:
    return lambda request: setattr(request.inputs[0], attr, value)


# case: (how to break a good request, the error it draws); what a mutation returns is unused.
BAD_RAW_REQUESTS: dict[str, tuple[Callable[[Request], object], str]] = {
    "wrong datatype": (_set("datatype", "FP64"), "inputs[0].datatype: expected FP32, got FP64"),
    "wrong feature dim": (_set_shape([2, 63]), "inputs[0].shape: expected [-1, 64], got [2, 63]"),
    "wrong rank": (_set_shape([2, 64, 1]), "inputs[0].shape: expected [-1, 64], got [2, 64, 1]"),
    "negative dim": (_set_shape([-1, 64]), "inputs[0].shape: dims must not be negative"),
    "zero rows": (_set_shape([0, 64]), "inputs[0].shape[0]: at least 1 row"),
    "too many rows": (
        _set_shape([MAX_ROWS + 1, 64]),
        "inputs[0].shape[0]: 9 rows exceed the limit of 8",
    ),
    "short raw buffer": (
        lambda r: r.raw_input_contents.__setitem__(0, r.raw_input_contents[0][:-4]),
        "raw_input_contents[0]: expected 512 bytes for shape [2, 64] FP32, got 508",
    ),
    "raw and typed together": (
        lambda r: r.inputs[0].contents.fp32_contents.extend([1.0]),
        "inputs[0].contents: typed contents (fp32_contents) given together with raw_input_contents",
    ),
    "two raw buffers for one input": (
        lambda r: r.raw_input_contents.append(b"\0" * 4),
        "raw_input_contents: expected one buffer per input (1), got 2",
    ),
    "unknown input": (
        _add_input("extra"),
        "inputs[1].name: unknown input 'extra'; the model takes ['features']",
    ),
    "duplicate input": (_add_input("features"), "inputs[1].name: duplicate input 'features'"),
    "missing input": (
        lambda r: (r.ClearField("inputs"), r.ClearField("raw_input_contents")),
        "inputs: missing input 'features'",
    ),
    "unknown output": (
        lambda r: r.outputs.add(name="logits"),
        "outputs[0].name: unknown output 'logits'; the model gives ['score']",
    ),
    "duplicate output": (
        lambda r: (r.outputs.add(name="score"), r.outputs.add(name="score")),
        "outputs[1].name: duplicate output 'score'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RAW_REQUESTS))
def test_bad_request_is_invalid_argument_naming_the_field(case: str) -> None:
    mutate, expected = BAD_RAW_REQUESTS[case]
    request = raw_request(rows(2))
    mutate(request)
    assert expected in refused(request)


def test_typed_contents_with_the_wrong_count_are_refused() -> None:
    request = typed_request(rows(2))
    request.inputs[0].contents.fp32_contents.pop()
    assert (
        "inputs[0].contents.fp32_contents: expected 128 values for shape [2, 64], got 127"
        in refused(request)
    )


def test_typed_contents_in_the_wrong_field_are_refused() -> None:
    request = typed_request(rows(1))
    request.inputs[0].contents.int_contents.extend([1])
    assert "inputs[0].contents: FP32 values belong in fp32_contents, got int_contents" in refused(
        request
    )


@pytest.mark.parametrize("n_rows", [2**62, 2**32 + 1], ids=["2^62 rows", "2^32+1 rows"])
def test_absurd_shapes_are_refused_without_allocating(n_rows: int) -> None:
    # 64 floats: what a 32-bit product of (2^32+1) x 64 would wrap around to.
    request = raw_request(rows(1), shape=[n_rows, FEATURES])
    tracemalloc.start()
    try:
        message = refused(request, max_rows=65536)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"inputs[0].shape[0]: {n_rows} rows exceed the limit" in message
    assert peak < 256 * 1024


def test_shape_product_is_bounded_even_within_the_row_limit() -> None:
    wide = Signature(
        TensorSig("features", "FP32", (-1, 2**40)), TensorSig("score", "FP32", (-1, 1))
    )
    request = Request()
    request.inputs.add(name="features", datatype="FP32", shape=[1, 2**40])
    request.raw_input_contents.append(b"\0" * 4)
    assert "inputs[0].shape: [1, 1099511627776] is 4398046511104 bytes, above" in refused(
        request, signature=wide
    )


def test_outputs_mirror_the_request_encoding() -> None:
    scores = np.array([[0.25], [0.75]], dtype=np.float32)
    raw = oip.ModelInferResponse()
    encode_outputs(raw, scores, SIGNATURE, ("score",), raw=True)
    assert raw.outputs[0].name == "score" and list(raw.outputs[0].shape) == [2, 1]
    assert raw.outputs[0].datatype == "FP32"
    np.testing.assert_array_equal(np.frombuffer(raw.raw_output_contents[0], "<f4"), [0.25, 0.75])
    typed = oip.ModelInferResponse()
    encode_outputs(typed, scores, SIGNATURE, ("score",), raw=False)
    assert list(typed.outputs[0].contents.fp32_contents) == [0.25, 0.75]
    assert not typed.raw_output_contents


def test_output_that_does_not_fit_the_signature_is_the_models_fault() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        encode_outputs(
            oip.ModelInferResponse(), np.zeros((2, 3), np.float32), SIGNATURE, ("score",), True
        )


def test_signature_from_registry_specs() -> None:
    spec = registry_pb2.ModelVersion(
        inputs=[registry_pb2.TensorSpec(name="features", datatype="FP32", shape=[-1, 64])],
        outputs=[registry_pb2.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])],
    )
    assert Signature.from_specs(spec.inputs, spec.outputs) == SIGNATURE


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([("a", "FP32", [-1, 4]), ("a", "INT64", [-1])], r"names must be unique, \['a'\] repeat"),
        ([], "at least one input and one output"),
        ([("a", "FP32", [4, 4])], "the first dim must be the batch dim -1"),
        ([("a", "FP32", [-1, -1])], "only the batch dim may be variable"),
        ([("a", "BYTES", [-1, 1])], "'BYTES' is not supported"),
    ],
)
def test_signatures_the_server_cannot_serve_are_refused(
    inputs: list[tuple[str, str, list[int]]], message: str
) -> None:
    specs = [registry_pb2.TensorSpec(name=n, datatype=d, shape=s) for n, d, s in inputs]
    output = [registry_pb2.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])]
    with pytest.raises(ValueError, match=message):
        Signature.from_specs(specs, output)


def test_the_short_answer_is_the_message_encode_outputs_builds() -> None:
    loaded = cast(LoadedModel, SimpleNamespace(model="fraud", version="v2", signature=SIGNATURE))
    scores = np.array([[0.25], [0.75]], dtype=np.float32)
    for zone in ("zone-a", ""):
        built = oip.ModelInferResponse(model_name="fraud", model_version="v2")
        built.parameters[REPLICA_PARAMETER].string_param = "model-0"
        if zone:
            built.parameters[ZONE_PARAMETER].string_param = zone
        encode_outputs(built, scores, SIGNATURE, ("score",), raw=True)
        assert _plain_answer(loaded, scores, True, "model-0", zone) == built
    # Typed requests and answers it cannot reproduce exactly take the full path.
    assert _plain_answer(loaded, scores, False, "model-0", "") is None
    assert _plain_answer(loaded, scores.astype(np.float64), True, "model-0", "") is None


def test_a_raw_request_with_empty_typed_contents_still_decodes() -> None:
    batch = rows(2)
    request = raw_request(batch)
    request.inputs[0].contents.SetInParent()  # present but empty: the full path decides
    np.testing.assert_array_equal(decode_request(request, SIGNATURE, MAX_ROWS).rows, batch)
