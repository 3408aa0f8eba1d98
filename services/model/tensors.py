"""Open Inference Protocol v2 tensors: validate a request against the model's signature,
decode its input to numpy, encode the model's output.

Validation happens before a request may join a batch, so one malformed request can never
poison the rows of others. Every failure raises `RequestError` (INVALID_ARGUMENT) with a
message that names the field, e.g. "inputs[0].shape: expected [-1, 64], got [2, 63]".

Output encoding mirrors the request: a request that sent `raw_input_contents` gets
`raw_output_contents` (little-endian, what tritonclient and the gateway read); a request that
sent typed contents (`fp32_contents`, ... - what grpcurl users write) gets typed contents.
Datatypes without a typed field (FP16) always come back raw.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from servemesh.services.model.errors import RequestError
from servemesh_api.inference import grpc_service_pb2 as oip

__all__ = [
    "DATATYPES",
    "DecodedRequest",
    "RequestError",
    "Signature",
    "TensorSig",
    "decode_request",
    "encode_outputs",
]


@dataclass(frozen=True)
class Datatype:
    name: str
    dtype: np.dtype[Any]  # always little-endian: the wire order of OIP raw contents
    typed_field: str | None  # the InferTensorContents field holding typed values, if any


def _dt(name: str, dtype: str, field: str | None) -> tuple[str, Datatype]:
    return name, Datatype(name, np.dtype(dtype), field)


DATATYPES: dict[str, Datatype] = dict(
    [
        _dt("BOOL", "|b1", "bool_contents"),
        _dt("UINT8", "|u1", "uint_contents"),
        _dt("UINT16", "<u2", "uint_contents"),
        _dt("UINT32", "<u4", "uint_contents"),
        _dt("UINT64", "<u8", "uint64_contents"),
        _dt("INT8", "|i1", "int_contents"),
        _dt("INT16", "<i2", "int_contents"),
        _dt("INT32", "<i4", "int_contents"),
        _dt("INT64", "<i8", "int64_contents"),
        _dt("FP16", "<f2", None),
        _dt("FP32", "<f4", "fp32_contents"),
        _dt("FP64", "<f8", "fp64_contents"),
    ]
)

# A hard ceiling on one decoded input, whatever the row limit says: shapes are checked with
# Python ints against it before anything is allocated.
MAX_INPUT_BYTES = 1 << 31


class _SpecLike(Protocol):
    name: str
    datatype: str
    shape: Sequence[int]


@dataclass(frozen=True)
class TensorSig:
    """One tensor of a model signature: the first dim is the batch dim (-1), the rest fixed."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def dims(self) -> tuple[int, ...]:
        """The fixed per-row dims (everything after the batch dim)."""
        return self.shape[1:]

    @property
    def row_elements(self) -> int:
        count = 1
        for dim in self.dims:
            count *= dim
        return count

    @property
    def dtype(self) -> np.dtype[Any]:
        return DATATYPES[self.datatype].dtype


@dataclass(frozen=True)
class Signature:
    """What a model takes and gives: one input and one output, both batched on dim 0.

    The model server runs `module(batch)`, so it hosts single-input, single-output models;
    signatures with more tensors are refused at load rather than half-served.
    """

    input: TensorSig
    output: TensorSig

    @classmethod
    def from_specs(
        cls, inputs: Sequence[_SpecLike], outputs: Sequence[_SpecLike], where: str = "signature"
    ) -> Signature:
        """A validated signature from registry TensorSpecs; raises ValueError naming the field."""
        if len(inputs) != 1 or len(outputs) != 1:
            raise ValueError(
                f"{where}: the model server hosts single-input single-output models, "
                f"got {len(inputs)} inputs and {len(outputs)} outputs"
            )
        return cls(
            input=_sig(inputs[0], f"{where}.inputs[0]"),
            output=_sig(outputs[0], f"{where}.outputs[0]"),
        )

    @property
    def inputs(self) -> tuple[TensorSig, ...]:
        return (self.input,)

    @property
    def outputs(self) -> tuple[TensorSig, ...]:
        return (self.output,)


def _sig(spec: _SpecLike, where: str) -> TensorSig:
    shape = tuple(int(d) for d in spec.shape)
    if spec.datatype not in DATATYPES:
        raise ValueError(
            f"{where}.datatype: {spec.datatype!r} is not supported; one of {sorted(DATATYPES)}"
        )
    if not shape or shape[0] != -1:
        raise ValueError(
            f"{where}.shape: the first dim must be the batch dim -1, got {list(shape)}"
        )
    if any(d <= 0 for d in shape[1:]):
        raise ValueError(f"{where}.shape: only the batch dim may be variable, got {list(shape)}")
    return TensorSig(name=spec.name, datatype=spec.datatype, shape=shape)


@dataclass(frozen=True)
class DecodedRequest:
    """A validated request: its input rows, how it sent them, which outputs it wants."""

    rows: np.ndarray  # (n_rows, *input.dims), the signature's dtype
    raw: bool  # the request used raw_input_contents (and so gets raw_output_contents)
    outputs: tuple[str, ...]  # requested output names, in the request's order (all if none)


def decode_request(
    request: oip.ModelInferRequest, signature: Signature, max_rows: int
) -> DecodedRequest:
    """Validate `request` against `signature` and decode its input rows.

    Raw contents are wrapped with np.frombuffer (no copy; the array is read-only). Raises
    RequestError naming the field for every way a request can be wrong.
    """
    raw = len(request.raw_input_contents) > 0
    if raw and len(request.raw_input_contents) != len(request.inputs):
        raise RequestError(
            f"raw_input_contents: expected one buffer per input ({len(request.inputs)}), "
            f"got {len(request.raw_input_contents)}"
        )
    known = {sig.name: sig for sig in signature.inputs}
    seen: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        where = f"inputs[{index}]"
        sig = known.get(tensor.name)
        if sig is None:
            raise RequestError(
                f"{where}.name: unknown input {tensor.name!r}; the model takes {sorted(known)}"
            )
        if tensor.name in seen:
            raise RequestError(f"{where}.name: duplicate input {tensor.name!r}")
        seen[tensor.name] = _decode_input(request, index, sig, max_rows, raw)
    for name in known:
        if name not in seen:
            raise RequestError(f"inputs: missing input {name!r}")
    return DecodedRequest(
        rows=seen[signature.input.name], raw=raw, outputs=_requested_outputs(request, signature)
    )


def _decode_input(
    request: oip.ModelInferRequest, index: int, sig: TensorSig, max_rows: int, raw: bool
) -> np.ndarray:
    where = f"inputs[{index}]"
    tensor = request.inputs[index]
    if tensor.datatype != sig.datatype:
        raise RequestError(
            f"{where}.datatype: expected {sig.datatype}, got {tensor.datatype or '(empty)'}"
        )
    shape = [int(d) for d in tensor.shape]
    if any(d < 0 for d in shape):
        raise RequestError(f"{where}.shape: dims must not be negative, got {shape}")
    if len(shape) != len(sig.shape) or tuple(shape[1:]) != sig.dims:
        raise RequestError(f"{where}.shape: expected {list(sig.shape)}, got {shape}")
    n_rows = shape[0]
    if n_rows < 1:
        raise RequestError(f"{where}.shape[0]: at least 1 row is required, got 0")
    if n_rows > max_rows:
        raise RequestError(
            f"{where}.shape[0]: {n_rows} rows exceed the limit of {max_rows} per request"
        )
    # Python ints cannot wrap: a shape whose product overflows int64 (or, wrapped to 32 bits,
    # would match a tiny buffer) is refused here, before anything is allocated.
    elements = n_rows * sig.row_elements
    dtype = sig.dtype
    expected_bytes = elements * dtype.itemsize
    if expected_bytes > MAX_INPUT_BYTES:
        raise RequestError(
            f"{where}.shape: {shape} is {expected_bytes} bytes, above {MAX_INPUT_BYTES}"
        )
    set_fields = [field.name for field, _ in tensor.contents.ListFields()]
    if raw:
        if set_fields:
            raise RequestError(
                f"{where}.contents: typed contents ({', '.join(set_fields)}) given together with "
                "raw_input_contents; send one or the other"
            )
        buffer = request.raw_input_contents[index]
        if len(buffer) != expected_bytes:
            raise RequestError(
                f"raw_input_contents[{index}]: expected {expected_bytes} bytes for shape {shape} "
                f"{sig.datatype}, got {len(buffer)}"
            )
        return np.frombuffer(buffer, dtype=dtype).reshape(shape)
    return _decode_typed(tensor, where, sig, shape, elements, set_fields)


def _decode_typed(
    tensor: oip.ModelInferRequest.InferInputTensor,
    where: str,
    sig: TensorSig,
    shape: list[int],
    elements: int,
    set_fields: list[str],
) -> np.ndarray:
    field = DATATYPES[sig.datatype].typed_field
    if field is None:
        raise RequestError(
            f"{where}.contents: {sig.datatype} has no typed field; send raw_input_contents"
        )
    stray = [name for name in set_fields if name != field]
    if stray:
        raise RequestError(
            f"{where}.contents: {sig.datatype} values belong in {field}, got {', '.join(stray)}"
        )
    values = getattr(tensor.contents, field)
    if len(values) != elements:
        raise RequestError(
            f"{where}.contents.{field}: expected {elements} values for shape {shape}, "
            f"got {len(values)}"
        )
    try:
        array = np.asarray(values, dtype=sig.dtype)
    except (OverflowError, ValueError) as exc:
        raise RequestError(
            f"{where}.contents.{field}: value out of range for {sig.datatype}"
        ) from exc
    return array.reshape(shape)


def _requested_outputs(request: oip.ModelInferRequest, signature: Signature) -> tuple[str, ...]:
    known = [sig.name for sig in signature.outputs]
    if not request.outputs:
        return tuple(known)
    names: list[str] = []
    for index, wanted in enumerate(request.outputs):
        if wanted.name not in known:
            raise RequestError(
                f"outputs[{index}].name: unknown output {wanted.name!r}; the model gives {known}"
            )
        if wanted.name in names:
            raise RequestError(f"outputs[{index}].name: duplicate output {wanted.name!r}")
        names.append(wanted.name)
    return tuple(names)


def encode_outputs(
    response: oip.ModelInferResponse,
    result: np.ndarray,
    signature: Signature,
    names: Iterable[str],
    raw: bool,
) -> None:
    """Add the model's output rows to `response`, raw or typed (see the module docstring).

    Raises ValueError when `result` does not fit the output signature: that is the model's
    fault, not the caller's, and becomes INTERNAL.
    """
    sig = signature.output
    if result.ndim < 1 or tuple(result.shape[1:]) != sig.dims:
        raise ValueError(f"model output shape {list(result.shape)} does not fit {list(sig.shape)}")
    values = np.ascontiguousarray(result, dtype=sig.dtype)
    typed_field = DATATYPES[sig.datatype].typed_field
    for name in names:
        # One output today; the loop keeps the request's order should that change.
        tensor = response.outputs.add(name=name, datatype=sig.datatype, shape=list(values.shape))
        if raw or typed_field is None:
            response.raw_output_contents.append(values.tobytes())
        else:
            getattr(tensor.contents, typed_field).extend(values.ravel().tolist())
