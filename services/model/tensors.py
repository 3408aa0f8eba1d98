"""Open Inference Protocol v2 tensors: validate a request against the model's signature,
decode its inputs to numpy, encode the model's outputs.

A signature names one or more inputs and one or more outputs, each batched on dim 0 with
fixed dims after it. Validation happens before a request may join a batch, so one malformed
request can never poison the rows of others: every input is checked fully (known name, no
duplicate, none missing, datatype, shape, dims that overflow, byte or value count, the same
row count as the other inputs), and so are the requested outputs. Every failure raises
`RequestError` (INVALID_ARGUMENT) with a message that names the field, e.g.
"inputs[1].datatype: input 'category' expects INT64, got FP32".

Decoded rows are one array for a one-input one-output model (the demo path, unchanged) and
`NamedRows` otherwise (see `batching.rows`).

Output encoding mirrors the request: a request that sent `raw_input_contents` gets
`raw_output_contents` (little-endian, what tritonclient and the gateway read); a request that
sent typed contents (`fp32_contents`, ... - what grpcurl users write) gets typed contents.
FP16 and BF16 have no typed field in OIP: they travel raw only (BF16 as the upper two bytes
of an FP32, little-endian, held here as uint16), and a response with any such output is all
raw, since OIP allows raw_output_contents only for every output or none.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from servemesh.services.model.batching.rows import NamedRows, Rows
from servemesh.services.model.errors import RequestError
from servemesh_api.inference import grpc_service_pb2 as oip

__all__ = [
    "DATATYPES",
    "DecodedRequest",
    "NamedRows",
    "RequestError",
    "Rows",
    "Signature",
    "TensorSig",
    "decode_request",
    "encode_outputs",
]


@dataclass(frozen=True)
class Datatype:
    name: str
    # Always little-endian: the wire order of OIP raw contents. BF16, which numpy lacks, is
    # held as its bit pattern in uint16 (the runner views it as torch.bfloat16).
    dtype: np.dtype[Any]
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
        _dt("BF16", "<u2", None),
        _dt("FP32", "<f4", "fp32_contents"),
        _dt("FP64", "<f8", "fp64_contents"),
    ]
)

# A hard ceiling on one decoded input, whatever the row limit says: shapes are checked with
# Python ints against it before anything is allocated.
MAX_INPUT_BYTES = 1 << 31


class _SpecLike(Protocol):
    """A tensor spec as the registry's records and protos both hold one (read-only)."""

    @property
    def name(self) -> str: ...

    @property
    def datatype(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...


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


@dataclass(frozen=True, init=False)
class Signature:
    """What a model takes and gives: named inputs and outputs, all batched on dim 0.

    `Signature(input, output)` is a one-input one-output model (its rows travel as one
    array); `Signature(inputs=[...], outputs=[...])` any other. Names are unique among the
    inputs and among the outputs. The model is called with its inputs in this order and its
    outputs are read in this order (or by name, when it returns a dict).
    """

    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]

    def __init__(
        self,
        input: TensorSig | None = None,
        output: TensorSig | None = None,
        *,
        inputs: Sequence[TensorSig] = (),
        outputs: Sequence[TensorSig] = (),
    ) -> None:
        ins = ((input,) if input is not None else ()) + tuple(inputs)
        outs = ((output,) if output is not None else ()) + tuple(outputs)
        for kind, tensors in (("inputs", ins), ("outputs", outs)):
            if not tensors:
                raise ValueError(f"signature: at least one of {kind} is required")
            names = [t.name for t in tensors]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"signature.{kind}: names must be unique, {dupes} repeat")
        object.__setattr__(self, "inputs", ins)
        object.__setattr__(self, "outputs", outs)

    @classmethod
    def from_specs(
        cls, inputs: Sequence[_SpecLike], outputs: Sequence[_SpecLike], where: str = "signature"
    ) -> Signature:
        """A validated signature from registry TensorSpecs; raises ValueError naming the field."""
        if not inputs or not outputs:
            raise ValueError(
                f"{where}: a model needs at least one input and one output, "
                f"got {len(inputs)} inputs and {len(outputs)} outputs"
            )
        sig_inputs = [_sig(spec, f"{where}.inputs[{i}]") for i, spec in enumerate(inputs)]
        sig_outputs = [_sig(spec, f"{where}.outputs[{i}]") for i, spec in enumerate(outputs)]
        try:
            return cls(inputs=sig_inputs, outputs=sig_outputs)
        except ValueError as exc:
            raise ValueError(str(exc).replace("signature", where, 1)) from None

    @property
    def single(self) -> bool:
        """One input and one output: rows travel as one array instead of NamedRows."""
        return len(self.inputs) == 1 and len(self.outputs) == 1

    @property
    def input(self) -> TensorSig:
        """The first input (the only one of a single-tensor model)."""
        return self.inputs[0]

    @property
    def output(self) -> TensorSig:
        """The first output (the only one of a single-tensor model)."""
        return self.outputs[0]

    def input_named(self, name: str) -> TensorSig | None:
        return next((sig for sig in self.inputs if sig.name == name), None)

    def output_named(self, name: str) -> TensorSig | None:
        return next((sig for sig in self.outputs if sig.name == name), None)


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

    # (n_rows, *input.dims) in the signature's dtype for a single-tensor model; else
    # NamedRows holding every input, in the signature's order.
    rows: Rows
    raw: bool  # the request used raw_input_contents (and so gets raw_output_contents)
    outputs: tuple[str, ...]  # requested output names, in the request's order (all if none)


@functools.lru_cache(maxsize=256)
def _raw_layout(sig: TensorSig) -> tuple[tuple[int, ...], int, np.dtype[Any]]:
    """(per-row dims, bytes per row, dtype) of an input: read once per signature."""
    return sig.dims, sig.row_elements * sig.dtype.itemsize, sig.dtype


def _decode_plain(
    request: oip.ModelInferRequest, signature: Signature, max_rows: int
) -> DecodedRequest | None:
    """The common request, decoded in a few attribute reads: one raw input of a one-input
    model, every check of the full path passed, no outputs named. None for anything else,
    which the full path then validates (and explains)."""
    if len(request.inputs) != 1 or len(request.raw_input_contents) != 1 or request.outputs:
        return None
    sig = signature.inputs[0]
    tensor = request.inputs[0]
    if (
        len(signature.inputs) != 1
        or len(signature.outputs) != 1
        or tensor.name != sig.name
        or tensor.datatype != sig.datatype
        or tensor.HasField("contents")
    ):
        return None
    dims, row_bytes, dtype = _raw_layout(sig)
    shape = tuple(tensor.shape)
    if len(shape) != len(dims) + 1 or shape[1:] != dims:
        return None
    n_rows = shape[0]
    buffer = request.raw_input_contents[0]
    if not 1 <= n_rows <= max_rows or len(buffer) != n_rows * row_bytes:
        return None
    if n_rows * row_bytes > MAX_INPUT_BYTES:
        return None
    rows = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    return DecodedRequest(rows=rows, raw=True, outputs=(signature.outputs[0].name,))


def decode_request(
    request: oip.ModelInferRequest, signature: Signature, max_rows: int
) -> DecodedRequest:
    """Validate `request` against `signature` and decode its input rows.

    Raw contents are wrapped with np.frombuffer (no copy; the array is read-only). Raises
    RequestError naming the field for every way a request can be wrong.
    """
    plain = _decode_plain(request, signature, max_rows)
    if plain is not None:
        return plain
    raw = len(request.raw_input_contents) > 0
    if raw and len(request.raw_input_contents) != len(request.inputs):
        raise RequestError(
            f"raw_input_contents: expected one buffer per input ({len(request.inputs)}), "
            f"got {len(request.raw_input_contents)}"
        )
    known = {sig.name: sig for sig in signature.inputs}
    seen: dict[str, np.ndarray] = {}
    first: tuple[int, str, int] | None = None  # (index, name, rows) of the first input
    for index, tensor in enumerate(request.inputs):
        where = f"inputs[{index}]"
        sig = known.get(tensor.name)
        if sig is None:
            raise RequestError(
                f"{where}.name: unknown input {tensor.name!r}; the model takes {sorted(known)}"
            )
        if tensor.name in seen:
            raise RequestError(f"{where}.name: duplicate input {tensor.name!r}")
        rows = _decode_input(request, index, sig, max_rows, raw)
        n_rows = int(rows.shape[0])
        if first is None:
            first = (index, tensor.name, n_rows)
        elif n_rows != first[2]:
            raise RequestError(
                f"{where}.shape[0]: input {tensor.name!r} has {n_rows} rows but "
                f"inputs[{first[0]}] {first[1]!r} has {first[2]}; every input carries the "
                "same rows"
            )
        seen[tensor.name] = rows
    for name in known:
        if name not in seen:
            raise RequestError(f"inputs: missing input {name!r}")
    outputs = _requested_outputs(request, signature)
    if signature.single:
        return DecodedRequest(rows=seen[signature.input.name], raw=raw, outputs=outputs)
    named = NamedRows({sig.name: seen[sig.name] for sig in signature.inputs})
    return DecodedRequest(rows=named, raw=raw, outputs=outputs)


def _decode_input(
    request: oip.ModelInferRequest, index: int, sig: TensorSig, max_rows: int, raw: bool
) -> np.ndarray:
    where = f"inputs[{index}]"
    tensor = request.inputs[index]
    if tensor.datatype != sig.datatype:
        # With several inputs the message names the one concerned as well as its index.
        named = f" for input {sig.name!r}" if len(request.inputs) > 1 else ""
        raise RequestError(
            f"{where}.datatype: expected {sig.datatype}{named}, got {tensor.datatype or '(empty)'}"
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
    result: Rows,
    signature: Signature,
    names: Iterable[str],
    raw: bool,
) -> None:
    """Add the model's output rows to `response`, raw or typed (see the module docstring).

    `result` is one array for a single-tensor signature, NamedRows otherwise. Raises
    ValueError when it does not fit the output signature: that is the model's fault, not the
    caller's, and becomes INTERNAL.
    """
    chosen: list[tuple[TensorSig, np.ndarray]] = []
    for name in names:
        sig = signature.output_named(name)
        if sig is None:
            raise ValueError(f"output {name!r} is not in the signature")
        if isinstance(result, NamedRows):
            if name not in result:
                raise ValueError(f"the model gave no output {name!r}")
            values = result[name]
        elif signature.single:
            values = result
        else:
            raise ValueError("a multi-tensor model must answer NamedRows")
        if values.ndim < 1 or tuple(values.shape[1:]) != sig.dims:
            raise ValueError(
                f"model output {name!r} shape {list(values.shape)} does not fit {list(sig.shape)}"
            )
        chosen.append((sig, np.ascontiguousarray(values, dtype=sig.dtype)))
    # OIP: raw_output_contents holds every output or none.
    fields = [DATATYPES[sig.datatype].typed_field for sig, _ in chosen]
    raw = raw or None in fields
    for (sig, values), field in zip(chosen, fields, strict=True):
        tensor = response.outputs.add(
            name=sig.name, datatype=sig.datatype, shape=list(values.shape)
        )
        if raw or field is None:
            response.raw_output_contents.append(values.tobytes())
        else:
            getattr(tensor.contents, field).extend(values.ravel().tolist())
