"""The public Tensor and the model's OIP tensors: each datatype's way between them.

A public `Tensor` (gateway.proto) holds its values in the one typed field of its datatype,
widened where protobuf has no narrower type: FP16 and BF16 travel as float, INT8/INT16 as
int32, UINT8/UINT16 as uint32. Toward the model every tensor goes raw, little-endian, in the
datatype the model takes (BF16 as the upper two bytes of an FP32, rounded to nearest even);
the model's outputs come back raw (or typed) and are widened the same way.

Every failure names the field: "inputs[\"tasting\"].shape: ...". Kept free of network code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from servemesh.services.runtime.errors import Internal, InvalidArgument
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2 as oip


@dataclass(frozen=True)
class Datatype:
    name: str
    wire: np.dtype[Any]  # the model's little-endian layout (BF16: its bits, as uint16)
    public_field: str  # the Tensor field holding its values
    public: np.dtype[Any]  # the numpy type of those values
    oip_field: str | None  # the OIP InferTensorContents field, if it has one

    @property
    def is_float(self) -> bool:
        return self.public.kind == "f"


def _dt(name: str, wire: str, field: str, public: str, oip_field: str | None) -> Datatype:
    return Datatype(name, np.dtype(wire), field, np.dtype(public), oip_field)


DATATYPES: dict[str, Datatype] = {
    d.name: d
    for d in (
        _dt("BOOL", "|b1", "bool_values", "bool", "bool_contents"),
        _dt("UINT8", "|u1", "uint_values", "uint32", "uint_contents"),
        _dt("UINT16", "<u2", "uint_values", "uint32", "uint_contents"),
        _dt("UINT32", "<u4", "uint_values", "uint32", "uint_contents"),
        _dt("UINT64", "<u8", "uint64_values", "uint64", "uint64_contents"),
        _dt("INT8", "|i1", "int_values", "int32", "int_contents"),
        _dt("INT16", "<i2", "int_values", "int32", "int_contents"),
        _dt("INT32", "<i4", "int_values", "int32", "int_contents"),
        _dt("INT64", "<i8", "int64_values", "int64", "int64_contents"),
        _dt("FP16", "<f2", "float_values", "float32", None),
        _dt("BF16", "<u2", "float_values", "float32", None),
        _dt("FP32", "<f4", "float_values", "float32", "fp32_contents"),
        _dt("FP64", "<f8", "double_values", "float64", "fp64_contents"),
    )
}
# What a Tensor without a datatype is taken to be, by the field its values are in.
_DEFAULT_FOR_FIELD = {
    "float_values": "FP32",
    "double_values": "FP64",
    "int64_values": "INT64",
    "int_values": "INT32",
    "uint64_values": "UINT64",
    "uint_values": "UINT32",
    "bool_values": "BOOL",
}
VALUE_FIELDS = tuple(_DEFAULT_FOR_FIELD)
# Elements one caller tensor may hold, checked before anything is allocated.
MAX_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class CallerTensor:
    """A caller's tensor, checked on its own: its values in their public type, shaped."""

    datatype: str  # as given; "" when the caller left it to the model
    field: str  # the value field it used
    values: np.ndarray  # shape as given, rows first

    @property
    def rows(self) -> int:
        return int(self.values.shape[0])


def read_tensor(tensor: gateway_pb2.Tensor, where: str) -> CallerTensor:
    """Check a caller's Tensor alone (datatype, shape, value count, finite floats); raises
    InvalidArgument naming the field."""
    if tensor.datatype and tensor.datatype not in DATATYPES:
        raise InvalidArgument(
            f"{where}.datatype: {tensor.datatype[:32]!r} is not one of {sorted(DATATYPES)}"
        )
    used = [name for name in VALUE_FIELDS if len(getattr(tensor, name))]
    if tensor.datatype:
        field = DATATYPES[tensor.datatype].public_field
        stray = [name for name in used if name != field]
        if stray:
            raise InvalidArgument(
                f"{where}: {tensor.datatype} values belong in {field}, got {', '.join(stray)}"
            )
    elif len(used) > 1:
        raise InvalidArgument(f"{where}: values in one field only, got {', '.join(used)}")
    elif used:
        field = used[0]
    else:
        field = "float_values"  # nothing sent: the shape check below says what is missing
    shape = [int(d) for d in tensor.shape]
    if not shape:
        raise InvalidArgument(f"{where}.shape: required, rows first (e.g. [1, 3])")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{where}.shape: dims must not be negative, got {shape}")
    if shape[0] < 1:
        raise InvalidArgument(f"{where}.shape[0]: at least one row, got {shape}")
    elements = 1
    for dim in shape:
        elements *= dim  # Python ints: a huge shape cannot wrap around
    if elements > MAX_ELEMENTS:
        raise InvalidArgument(f"{where}.shape: {shape} holds more than {MAX_ELEMENTS} values")
    values = getattr(tensor, field)
    if len(values) != elements:
        raise InvalidArgument(
            f"{where}.{field}: shape {shape} holds {elements} values, got {len(values)}"
        )
    datatype = DATATYPES[tensor.datatype or _DEFAULT_FOR_FIELD[field]]
    array = np.asarray(values, dtype=datatype.public).reshape(shape)
    if datatype.is_float and not np.isfinite(array).all():
        index = int(np.argwhere(~np.isfinite(array.ravel()))[0][0])
        raise InvalidArgument(f"{where}.{field}[{index}]: not a finite number")
    return CallerTensor(datatype=tensor.datatype, field=field, values=array)


def conform(
    tensor: CallerTensor, datatype: str, shape: tuple[int, ...], where: str, model: str
) -> np.ndarray:
    """The caller's tensor as the model takes it (`datatype`, `shape` with -1 rows), in its
    wire layout; raises InvalidArgument naming the field when it does not fit."""
    want = DATATYPES[datatype]
    if tensor.datatype and tensor.datatype != datatype:
        raise InvalidArgument(
            f"{where}.datatype: model {model!r} takes {datatype}, got {tensor.datatype}"
        )
    if not tensor.datatype and tensor.field != want.public_field:
        # No datatype named (the CLI's numbers, a quick grpcurl call): any field will do
        # whose values the model's datatype holds exactly.
        _check_exact(tensor.values, datatype, f"{where}.{tensor.field}", model)
    per_row = 1
    for dim in shape[1:]:
        per_row *= dim
    got = [int(d) for d in tensor.values.shape]
    got_per_row = tensor.values.size // max(got[0], 1)
    if got_per_row != per_row:
        raise InvalidArgument(
            f"{where}.shape: model {model!r} takes {list(shape)} ({per_row} values per row), "
            f"got {got}"
        )
    rows = tensor.values.reshape((got[0], *shape[1:]))
    return to_wire(rows, datatype, where)


def _check_exact(values: np.ndarray, datatype: str, where: str, model: str) -> None:
    kind = DATATYPES[datatype].wire.kind
    if datatype == "BF16" or kind == "f":
        return  # any number is a float, rounded to the model's precision
    if kind == "b":
        bad = values[(values != 0) & (values != 1)]
    elif values.dtype.kind == "f":
        bad = values[values != np.round(values)]
    else:
        return  # integers: to_wire checks their range
    if bad.size:
        raise InvalidArgument(
            f"{where}: model {model!r} takes {datatype}; {bad.ravel()[0].item()!r} is not one"
        )


def to_wire(values: np.ndarray, datatype: str, where: str) -> np.ndarray:
    """`values` (public or wider types) in the model's little-endian layout for `datatype`;
    raises InvalidArgument naming `where` for a value the datatype cannot hold."""
    want = DATATYPES[datatype]
    if values.dtype == want.wire and datatype != "BF16":
        return np.ascontiguousarray(values)  # already the model's (the demo's FP32 rows)
    if datatype == "BF16":
        return _bf16_bits(np.asarray(values, dtype=np.float32), where)
    if want.wire.kind in "iu" and values.size:
        info = np.iinfo(want.wire)
        low, high = values.min(), values.max()
        if int(low) < info.min or int(high) > info.max:
            raise InvalidArgument(f"{where}: a value is out of range for {datatype}")
    with np.errstate(over="ignore"):
        wire = np.ascontiguousarray(values, dtype=want.wire)
    if want.is_float and values.size and not np.isfinite(wire).all():
        raise InvalidArgument(f"{where}: a value is out of range for {datatype}")
    return wire


def _bf16_bits(values: np.ndarray, where: str) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate.
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype("<u2")
    if values.size and not np.isfinite(from_bf16_bits(out)).all():
        raise InvalidArgument(f"{where}: a value is out of range for BF16")
    return out


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) as float32."""
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def to_public(values: np.ndarray, datatype: str) -> gateway_pb2.Tensor:
    """A model's output (wire layout) as a public Tensor, widened where protobuf must."""
    spec = DATATYPES[datatype]
    if datatype == "BF16":
        public = from_bf16_bits(values)
    else:
        public = np.asarray(values).astype(spec.public)
    tensor = gateway_pb2.Tensor(datatype=datatype, shape=[int(d) for d in values.shape])
    getattr(tensor, spec.public_field).extend(public.ravel().tolist())
    return tensor


def decode_output(response: oip.ModelInferResponse, index: int) -> np.ndarray:
    """Output `index` of a model's answer in its wire layout, shaped; raises Internal when it
    is malformed (the model's fault, not the caller's)."""
    output = response.outputs[index]
    spec = DATATYPES.get(output.datatype)
    if spec is None:
        raise Internal(f"model output {output.name!r} has datatype {output.datatype!r}")
    shape = [int(d) for d in output.shape]
    if not shape or any(d < 0 for d in shape):
        raise Internal(f"model output {output.name!r} has shape {shape}")
    if response.raw_output_contents:
        if index >= len(response.raw_output_contents):
            raise Internal("model answered fewer raw outputs than outputs")
        buffer = response.raw_output_contents[index]
        count = 1
        for dim in shape:
            count *= dim
        if len(buffer) != count * spec.wire.itemsize:
            raise Internal(f"model output {output.name!r}: {len(buffer)} bytes for {shape}")
        return np.frombuffer(buffer, dtype=spec.wire).reshape(shape)
    if spec.oip_field is None:
        raise Internal(f"model output {output.name!r} ({output.datatype}) came without raw bytes")
    values = np.asarray(getattr(output.contents, spec.oip_field), dtype=spec.wire)
    try:
        return values.reshape(shape)
    except ValueError:
        raise Internal(f"model output {output.name!r}: {values.size} values for {shape}") from None
