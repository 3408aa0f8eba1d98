"""The pipe between a caller and its sandboxed model process: framed JSON and raw arrays.

One frame is a 4-byte big-endian header length, a JSON header, then the bytes of each
blob the header lists. Arrays travel as their raw bytes with their dtype and shape in the
header, from a short list of dtypes: the caller never unpickles, and never trusts a size
the other side states before checking it against its limit.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from servemesh.contract.errors import ServemeshError

_HEADER = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 20
# The dtypes an array may travel as: every OIP datatype's numpy form (no objects).
DTYPES = frozenset(
    {"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
     "float16", "float32", "float64", "bytes"}
)  # fmt: skip


class FrameError(ServemeshError, ValueError):
    """The other side sent something that is not a frame within the limits."""


class PeerGone(ServemeshError, EOFError):
    """The other side closed the pipe (it exited) before a whole frame arrived."""


@dataclass
class Frame:
    """A header (a JSON object) and the arrays that travel with it, by name."""

    header: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    blob: bytes = b""


def write_frame(out: BinaryIO, frame: Frame) -> None:
    """Send `frame` whole, then flush."""
    layout = []
    parts: list[bytes] = []
    for name, array in frame.arrays.items():
        contiguous = np.ascontiguousarray(array)
        dtype = contiguous.dtype.name if contiguous.dtype.kind != "S" else "bytes"
        if dtype not in DTYPES:
            raise FrameError(f"array {name!r}: dtype {contiguous.dtype} does not travel")
        itemsize = contiguous.dtype.itemsize
        layout.append([name, dtype, list(contiguous.shape), itemsize, contiguous.nbytes])
        parts.append(contiguous.tobytes())
    header = dict(frame.header, arrays=layout, blob=len(frame.blob))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    out.write(_HEADER.pack(len(encoded)) + encoded)
    for part in parts:
        out.write(part)
    out.write(frame.blob)
    out.flush()


class FrameReader:
    """Reads frames from a pipe's descriptor, each within `limit_bytes` and, when given,
    before a deadline (time.monotonic())."""

    def __init__(self, fd: int, limit_bytes: int) -> None:
        self._fd = fd
        self._limit = limit_bytes

    def read(self, deadline: float | None = None) -> Frame:
        (size,) = _HEADER.unpack(self._exact(_HEADER.size, deadline))
        if size > MAX_HEADER_BYTES:
            raise FrameError(f"a header of {size} bytes (at most {MAX_HEADER_BYTES})")
        try:
            header = json.loads(self._exact(size, deadline))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FrameError(f"a header that is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise FrameError("a header that is not a JSON object")
        layout = header.pop("arrays", [])
        blob_size = header.pop("blob", 0)
        _check_layout(layout, blob_size, self._limit)
        arrays = {}
        for name, dtype, shape, _itemsize, nbytes in layout:
            data = self._exact(nbytes, deadline)
            arrays[name] = _array(name, dtype, shape, data)
        blob = self._exact(blob_size, deadline) if blob_size else b""
        return Frame(header, arrays, blob)

    def _exact(self, n: int, deadline: float | None) -> bytes:
        chunks: list[bytes] = []
        left = n
        while left:
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0 or not select.select([self._fd], [], [], wait)[0]:
                    raise TimeoutError("no answer from the sandboxed model in time")
            chunk = os.read(self._fd, min(left, 1 << 20))
            if not chunk:
                raise PeerGone("the other side closed the pipe")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


def _check_layout(layout: object, blob_size: object, limit: int) -> None:
    if not isinstance(layout, list) or not isinstance(blob_size, int) or blob_size < 0:
        raise FrameError("a header whose arrays or blob are malformed")
    total = blob_size
    for entry in layout:
        if (
            not isinstance(entry, list)
            or len(entry) != 5
            or not isinstance(entry[0], str)
            or entry[1] not in DTYPES
            or not isinstance(entry[2], list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[2])
            or not isinstance(entry[3], int)
            or not isinstance(entry[4], int)
            or entry[4] < 0
        ):
            raise FrameError(f"a malformed array entry {str(entry)[:80]}")
        total += entry[4]
    if total > limit:
        raise FrameError(f"a frame of {total} bytes (at most {limit})")


def _array(name: str, dtype: str, shape: list[int], data: bytes) -> np.ndarray:
    count = 1
    for dim in shape:
        count *= dim
    if dtype == "bytes":
        if count == 0:
            return np.zeros(shape, dtype="S1")
        if len(data) % count:
            raise FrameError(f"array {name!r}: {len(data)} bytes for {count} strings")
        kind = np.dtype(f"S{max(len(data) // count, 1)}")
    else:
        kind = np.dtype(dtype)
    if count * kind.itemsize != len(data):
        raise FrameError(f"array {name!r}: {len(data)} bytes for shape {shape} of {dtype}")
    return np.frombuffer(data, dtype=kind).reshape(shape).copy()


def arrays_of(rows: object, single_name: str) -> dict[str, np.ndarray]:
    """A runner's answer (one array, or arrays by name) as arrays by name."""
    if isinstance(rows, Mapping):
        return {str(k): np.asarray(v) for k, v in rows.items()}
    return {single_name: np.asarray(rows)}
