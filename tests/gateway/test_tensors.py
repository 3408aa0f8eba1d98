"""The public Tensor and the model's OIP tensors, each datatype both ways."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from servemesh.services.gateway.tensors import (
    DATATYPES,
    conform,
    decode_output,
    from_bf16_bits,
    read_tensor,
    to_public,
    to_wire,
)
from servemesh.services.runtime.errors import MeshError
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2 as oip

# datatype -> (values the caller writes, the numpy type the model reads them as)
CASES: dict[str, tuple[list[float] | list[int] | list[bool], str]] = {
    "FP32": ([0.5, -1.25, 3.0, 1e30], "<f4"),
    "FP64": ([0.1, -2.5, 1e300, 7.0], "<f8"),
    "FP16": ([0.5, -1.25, 3.0, 65504.0], "<f2"),
    "INT64": ([2**40, -(2**40), 0, 7], "<i8"),
    "INT32": ([2**31 - 1, -(2**31), 0, 7], "<i4"),
    "INT16": ([32767, -32768, 0, 7], "<i2"),
    "INT8": ([127, -128, 0, 7], "|i1"),
    "UINT64": ([2**63, 0, 1, 7], "<u8"),
    "UINT32": ([2**32 - 1, 0, 1, 7], "<u4"),
    "UINT16": ([65535, 0, 1, 7], "<u2"),
    "UINT8": ([255, 0, 1, 7], "|u1"),
    "BOOL": ([True, False, False, True], "|b1"),
}


def _tensor(datatype: str, values: list[float] | list[int] | list[bool]) -> gateway_pb2.Tensor:
    tensor = gateway_pb2.Tensor(datatype=datatype, shape=[2, 2])
    getattr(tensor, DATATYPES[datatype].public_field).extend(values)
    return tensor


@pytest.mark.parametrize("datatype", sorted(CASES))
def test_each_datatype_goes_to_the_model_and_back_unchanged(datatype: str) -> None:
    values, wire_type = CASES[datatype]
    caller = read_tensor(_tensor(datatype, values), "inputs['x']")
    wire = conform(caller, datatype, (-1, 2), "inputs['x']", "m")
    assert wire.dtype == np.dtype(wire_type) and wire.shape == (2, 2)
    assert wire.ravel().tolist() == pytest.approx(values)
    # The model answers the same bytes: the caller reads the same values.
    reply = oip.ModelInferResponse(raw_output_contents=[wire.tobytes()])
    reply.outputs.add(name="y", datatype=datatype, shape=[2, 2])
    public = to_public(decode_output(reply, 0), datatype)
    assert public.datatype == datatype and list(public.shape) == [2, 2]
    assert list(getattr(public, DATATYPES[datatype].public_field)) == pytest.approx(values)


def test_bf16_is_rounded_to_nearest_even_like_torch_and_read_back_as_float() -> None:
    values = np.array([1.0, 1.00390625, 1.01171875, -3.14159, 1e38, 2.0**-130], dtype=np.float32)
    bits = to_wire(values, "BF16", "x")
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
    assert bits.view("<i2").tolist() == expected.tolist()
    assert from_bf16_bits(bits).tolist() == (
        torch.from_numpy(values).to(torch.bfloat16).float().numpy().tolist()
    )
    public = to_public(bits.reshape(2, 3), "BF16")
    assert list(public.float_values) == pytest.approx(from_bf16_bits(bits).tolist())


def test_typed_outputs_are_read_too() -> None:
    reply = oip.ModelInferResponse()
    reply.outputs.add(name="label", datatype="INT64", shape=[3]).contents.int64_contents.extend(
        [1, 2, 3]
    )
    assert decode_output(reply, 0).tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (gateway_pb2.Tensor(datatype="FP8", shape=[1]), r"x.datatype: 'FP8' is not one of"),
        (
            gateway_pb2.Tensor(datatype="FP32", shape=[1], double_values=[1.0]),
            r"x: FP32 values belong in float_values, got double_values",
        ),
        (
            gateway_pb2.Tensor(shape=[1], float_values=[1.0], int_values=[1]),
            r"x: values in one field only",
        ),
        (gateway_pb2.Tensor(float_values=[1.0]), r"x.shape: required"),
        (gateway_pb2.Tensor(shape=[0, 3]), r"x.shape\[0\]: at least one row"),
        (gateway_pb2.Tensor(shape=[1, -3]), r"x.shape: dims must not be negative"),
        (gateway_pb2.Tensor(shape=[1 << 20, 1 << 20]), r"x.shape: .* holds more than"),
        (
            gateway_pb2.Tensor(shape=[2], float_values=[1.0]),
            r"x.float_values: shape \[2\] holds 2 values, got 1",
        ),
        (
            gateway_pb2.Tensor(datatype="FP64", shape=[2], double_values=[1.0, float("inf")]),
            r"x.double_values\[1\]: not a finite number",
        ),
    ],
)
def test_a_bad_caller_tensor_names_its_field(tensor: gateway_pb2.Tensor, message: str) -> None:
    with pytest.raises(MeshError, match=message) as err:
        read_tensor(tensor, "x")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("datatype", "tensor"),
    [
        ("INT8", gateway_pb2.Tensor(datatype="INT8", shape=[1], int_values=[128])),
        ("UINT16", gateway_pb2.Tensor(datatype="UINT16", shape=[1], uint_values=[65536])),
        ("FP16", gateway_pb2.Tensor(datatype="FP16", shape=[1], float_values=[70000.0])),
        ("BF16", gateway_pb2.Tensor(datatype="BF16", shape=[1], float_values=[3.4e38])),
    ],
)
def test_a_value_the_models_datatype_cannot_hold_is_refused(
    datatype: str, tensor: gateway_pb2.Tensor
) -> None:
    caller = read_tensor(tensor, "inputs['x']")
    with pytest.raises(MeshError, match=rf"inputs\['x'\]: a value is out of range for {datatype}"):
        conform(caller, datatype, (-1,), "inputs['x']", "m")


def test_a_tensor_without_a_datatype_takes_the_models_when_its_values_fit() -> None:
    caller = read_tensor(gateway_pb2.Tensor(shape=[1, 2], double_values=[0.5, 1.5]), "x")
    assert conform(caller, "FP16", (-1, 2), "x", "m").tolist() == [[0.5, 1.5]]
    with pytest.raises(MeshError, match=r"x.double_values: model 'm' takes INT64; 0.5 is not one"):
        conform(caller, "INT64", (-1, 2), "x", "m")
    whole = read_tensor(gateway_pb2.Tensor(shape=[2], double_values=[3.0, 4.0]), "x")
    assert conform(whole, "INT64", (-1,), "x", "m").tolist() == [3, 4]
    ints = read_tensor(gateway_pb2.Tensor(shape=[2], int64_values=[1, 0]), "x")
    assert conform(ints, "BOOL", (-1,), "x", "m").tolist() == [True, False]
    assert conform(ints, "FP32", (-1,), "x", "m").dtype == np.dtype("<f4")
    with pytest.raises(MeshError, match="x.int64_values: model 'm' takes BOOL; 3 is not one"):
        conform(
            read_tensor(gateway_pb2.Tensor(shape=[1], int64_values=[3]), "x"),
            "BOOL",
            (-1,),
            "x",
            "m",
        )
    # A named datatype is held to: the caller said what it meant.
    named = read_tensor(gateway_pb2.Tensor(datatype="FP64", shape=[1], double_values=[1.0]), "x")
    with pytest.raises(MeshError, match="x.datatype: model 'm' takes FP32, got FP64"):
        conform(named, "FP32", (-1,), "x", "m")


@pytest.mark.parametrize(
    ("datatype", "shape", "raw", "message"),
    [
        ("BYTES", [1], b"", "datatype"),
        ("FP32", [2], b"\0" * 4, "4 bytes"),
        ("FP16", [1], None, "without raw"),
    ],
)
def test_a_malformed_model_answer_is_internal(
    datatype: str, shape: list[int], raw: bytes | None, message: str
) -> None:
    reply = oip.ModelInferResponse(raw_output_contents=[raw] if raw is not None else [])
    reply.outputs.add(name="y", datatype=datatype, shape=shape)
    with pytest.raises(MeshError, match=message) as err:
        decode_output(reply, 0)
    assert err.value.code == grpc.StatusCode.INTERNAL
