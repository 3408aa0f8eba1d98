"""What a record keeps of the feature vector a call sent its model: always a hash of the
values and their count, and the values themselves for a model whose spec sets
`log_features: true` (callers' rows are theirs otherwise).

The vector is the call's model inputs as the model got them (every input tensor, in the
model's wire layout: view-filled features and the caller's raw tensors alike). The request
path keeps a reference to them (`PredictWatch.model_inputs`); the hash and the JSON are made
here, in the writer's thread. A vector larger than HOLD_BYTES is hashed on the request path
instead and its values are not kept: a buffer full of references to large tensors would
hold far more memory than `buffer_records` suggests.

The hash: sha256 over each input in name order (its name, datatype and shape, then its
little-endian bytes), hex, the first HASH_HEX digits. Two calls with the same values for the
same model hash alike, whichever gateway logged them: replay and deduplication key on it.

The values: JSON, one list per feature (column) holding each row's value,
`{"f00": [0.12, -1.3], "f01": [...]}`; whole rows, as many as fit in `max_bytes`. A
view-filled input's columns are named by its features; a raw input's by the tensor's name
(`tasting`), or `tasting[0]`, `tasting[1]`, ... when a row holds several values. A name two
inputs give different values under is qualified by its view (`user.f00`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from servemesh.spec import ModelInputSpec

# A call whose inputs hold more bytes than this is hashed at once and keeps no values.
HOLD_BYTES = 64 * 1024
# Hex digits of the sha256 a record keeps (128 bits).
HASH_HEX = 32

_NAME = json.JSONEncoder(separators=(",", ":"))


class TensorType(Protocol):
    """One input of the model's signature (services/gateway/predict.py TensorMeta)."""

    @property
    def name(self) -> str: ...
    @property
    def datatype(self) -> str: ...


def feature_hash(types: Sequence[TensorType], inputs: Mapping[str, np.ndarray]) -> tuple[str, int]:
    """The vector's hash (HASH_HEX hex digits) and how many values it holds."""
    datatypes = {t.name: t.datatype for t in types}
    digest = hashlib.sha256()
    count = 0
    for name in sorted(inputs):
        array = np.ascontiguousarray(inputs[name])
        shape = ",".join(str(n) for n in array.shape)
        digest.update(f"{name}\0{datatypes.get(name, array.dtype.str)}\0{shape}\0".encode())
        digest.update(array.data.cast("B"))
        count += int(array.size)
    return digest.hexdigest()[:HASH_HEX], count


def held_bytes(inputs: Mapping[str, np.ndarray]) -> int:
    return sum(int(a.nbytes) for a in inputs.values())


@dataclass(frozen=True)
class Column:
    name: str
    input: str
    index: int  # within one row of the input


def feature_columns(
    model_inputs: Mapping[str, ModelInputSpec], widths: Mapping[str, int]
) -> list[Column]:
    """The named columns of a call's inputs (`widths`: values per row of each input), in
    the order the model takes its inputs (`model_inputs`, then any the spec does not list)."""
    entries: list[tuple[str, str, Column]] = []  # (base name, qualified name, column)
    seen: set[tuple[str, str]] = set()
    order = [n for n in model_inputs if n in widths] + [n for n in widths if n not in model_inputs]
    for input_name in order:
        width = widths[input_name]
        spec = model_inputs.get(input_name)
        features = spec.features if spec is not None and not spec.raw else None
        if features is not None and len(features) == width and spec is not None:
            for index, feature in enumerate(features):
                key = (spec.view or "", feature)
                if key in seen:  # the same view's feature in two inputs: the same values
                    continue
                seen.add(key)
                qualified = f"{spec.view}.{feature}"
                entries.append((feature, qualified, Column(feature, input_name, index)))
            continue
        for index in range(width):
            name = input_name if width == 1 else f"{input_name}[{index}]"
            entries.append((name, name, Column(name, input_name, index)))
    counts: dict[str, int] = {}
    for base, _, _ in entries:
        counts[base] = counts.get(base, 0) + 1
    return [
        column if counts[base] == 1 else Column(qualified, column.input, column.index)
        for base, qualified, column in entries
    ]


def _public(array: np.ndarray, datatype: str) -> np.ndarray:
    if datatype == "BF16":  # the upper half of an FP32, carried as uint16 bits
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def _texts(values: np.ndarray) -> list[str]:
    """Each value as JSON text (a non-finite float as null)."""
    kind = values.dtype.kind
    if kind == "b":
        return ["true" if v else "false" for v in values.tolist()]
    if kind in "iu":
        return [str(v) for v in values.tolist()]
    spec = _FLOAT_64 if values.dtype.itemsize >= 8 else _FLOAT_32
    return [spec % v if math.isfinite(v) else "null" for v in values.tolist()]


def _column_texts(matrix: np.ndarray) -> list[str]:
    """Each column of `matrix` (rows x width) as its values' JSON texts joined with commas:
    one pass over the matrix, not one per column."""
    rows, width = matrix.shape
    kind = matrix.dtype.kind
    if kind in "iu":
        flat = list(map(str, matrix.T.ravel().tolist()))
    elif kind == "f" and np.isfinite(matrix).all():
        spec = _FLOAT_64 if matrix.dtype.itemsize >= 8 else _FLOAT_32
        flat = list(map(spec.__mod__, matrix.T.ravel().tolist()))
    else:
        flat = _texts(matrix.T.ravel())
    if rows == 1:
        return flat
    return [",".join(flat[i * rows : (i + 1) * rows]) for i in range(width)]


# float32 widened to a Python float prints 17 digits; 7 significant are all it holds.
_FLOAT_32 = "%.7g"
_FLOAT_64 = "%.17g"
# The columns of each (model's inputs, row widths) seen, and their JSON heads (`"f00":[`): a writer
# formats thousands of records of a few layouts. Each entry holds its inputs mapping, so
# its id cannot be reused while the entry lives.
_LAYOUTS: dict[
    tuple[int, tuple[tuple[str, int], ...]],
    tuple[Mapping[str, ModelInputSpec], list[Column], list[str]],
] = {}
_MAX_LAYOUTS = 256


def _layout(
    model_inputs: Mapping[str, ModelInputSpec], widths: dict[str, int]
) -> tuple[list[Column], list[str]]:
    key = (id(model_inputs), tuple(widths.items()))
    found = _LAYOUTS.get(key)
    if found is not None and found[0] is model_inputs:
        return found[1], found[2]
    columns = feature_columns(model_inputs, widths)
    heads = [_NAME.encode(c.name) + ":[" for c in columns]
    if len(_LAYOUTS) >= _MAX_LAYOUTS:
        _LAYOUTS.clear()
    _LAYOUTS[key] = (model_inputs, columns, heads)
    return columns, heads


def features_json(
    model_inputs: Mapping[str, ModelInputSpec],
    types: Sequence[TensorType],
    inputs: Mapping[str, np.ndarray],
    max_bytes: int,
) -> str:
    """The call's values as JSON of at most `max_bytes`, a list per column (see above):
    whole rows, as many as fit; when not even one row does, its first columns."""
    datatypes = {t.name: t.datatype for t in types}
    rows = min((int(a.shape[0]) for a in inputs.values() if a.ndim), default=0)
    if rows == 0:
        return "{}"
    matrices = {
        name: _public(array, datatypes.get(name, "")).reshape(array.shape[0], -1)
        for name, array in inputs.items()
        if array.ndim
    }
    columns, heads = _layout(model_inputs, {n: m.shape[1] for n, m in matrices.items()})
    if not columns:
        return "{}"
    # Each value takes at least two bytes with its comma: rows past that bound cannot fit.
    kept_rows = min(rows, max_bytes // (2 * len(columns)) + 1)
    if kept_rows == rows:
        # Most calls fit whole: one text per column, no per-row accounting.
        joined = {name: _column_texts(matrix) for name, matrix in matrices.items()}
        whole = [joined[c.input][c.index] for c in columns]
        text = "{" + ",".join([h + t + "]" for h, t in zip(heads, whole, strict=True)]) + "}"
        if len(text) <= max_bytes:
            return text
    texts = [_texts(matrices[c.input][:kept_rows, c.index]) for c in columns]
    # Bytes of the object with its columns and no values: {"a":[],"b":[]}.
    size = 2 + sum(len(h) + 1 for h in heads) + len(columns) - 1
    fit = 0
    for row in range(kept_rows):
        grown = size + sum(len(t[row]) for t in texts) + (len(columns) if row else 0)
        if grown > max_bytes:
            break
        size, fit = grown, row + 1
    if fit:
        return (
            "{"
            + ",".join(f"{h}{','.join(t[:fit])}]" for h, t in zip(heads, texts, strict=True))
            + "}"
        )
    parts: list[str] = []
    size = 2
    for head, values in zip(heads, texts, strict=True):
        part = f"{head}{values[0]}]"
        if size + len(part) + (1 if parts else 0) > max_bytes:
            break
        parts.append(part)
        size += len(part) + (1 if len(parts) > 1 else 0)
    return "{" + ",".join(parts) + "}"


def parse_features(value: Any) -> dict[str, list[Any]]:
    """A record's `features` as the stores give it back (JSON text from Parquet, parsed
    jsonb from PostgreSQL, null when none was kept): lists by column, {} for none."""
    if value is None or value == "":
        return {}
    found = json.loads(value) if isinstance(value, str | bytes) else value
    if not isinstance(found, dict):
        return {}
    return {str(k): v for k, v in found.items() if isinstance(v, list)}
