"""One prediction's record: what a request captures, and the row the writer makes of it.

The request path only captures (a few references, floats and the entity ids, in the
`PredictWatch` of the call); the writer's thread turns a batch of them into rows
(`to_row`): JSON, caps, trace ids, the feature vector's hash (servemesh/predlog/features.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc
import numpy as np

from servemesh.contract.wire import TENSOR_VALUE_FIELDS, TRACE_HEADERS
from servemesh.predlog.features import (
    HOLD_BYTES,
    TensorType,
    feature_hash,
    features_json,
    held_bytes,
)
from servemesh.spec import ModelInputSpec
from servemesh_api.gateway.v1 import gateway_pb2

T = TypeVar("T")

# The columns of a stored record, in order. Each store maps them to its own types.
COLUMNS: tuple[str, ...] = (
    "ts",  # when the call arrived, UTC
    "request_id",
    "trace_id",  # from the caller's W3C traceparent; "" without one
    "gateway",  # the gateway instance that answered, and its zone
    "gateway_zone",
    "model",
    "version",  # the version that answered ("fallback" for a degraded answer), else pinned
    "replica",  # the model replica that answered, and its zone
    "zone",
    "entities",  # JSON: entity ids by entity name, {"user": ["user-42"]}
    "entity_keys",  # the same as "name=id" strings, for lookups
    "outputs",  # JSON: each output by name (capped), {"score": [[0.63]]}
    "feature_ms",  # time spent on feature lookups (null: never reached)
    "inference_ms",  # time spent on the model call (null: never reached)
    "total_ms",
    "status",  # gRPC status code name the caller got
    "message",  # its message (capped); "" when OK
    "degraded",
    "degraded_reason",
    "tier",  # which tier answered: online, cache or precomputed ("" when none did)
    "feature_hash",  # sha256 of the values the model was sent, hex ("" when none were)
    "feature_count",  # how many values that was (rows x features)
    "features",  # JSON: those values by feature (capped), for a model with log_features
)

Row = tuple[Any, ...]

# One encoder for every row (json.dumps with options builds a new one per call).
_JSON = json.JSONEncoder(separators=(",", ":"))
_TRACEPARENT = TRACE_HEADERS[0]  # W3C traceparent: version-traceid-spanid-flags
_TRACE_ID = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


class PredictWatch:
    """One Predict: times its feature and model calls while it runs, and once it ends
    (answered or failed) is itself the record the log keeps.

    Built for the request path: slots, no formatting, no copies beyond the entity ids (a
    reference to the request would keep its tensors alive in the buffer). The writer's
    thread reads the fields; nothing writes them after the watch is handed to the sink.
    """

    __slots__ = (
        "_sink",
        "_cap",
        "_t0",
        "_request",
        "at",
        "request_id",
        "metadata",
        "model",
        "pinned_version",
        "entity_ids",
        "entity_rows",
        "answer",
        "status",
        "message",
        "feature_s",
        "inference_s",
        "total_s",
        "inputs",
        "input_types",
        "feature_hash",
        "feature_count",
    )

    def __init__(
        self,
        sink: Callable[[PredictWatch], None],
        cap: int,
        request: gateway_pb2.PredictRequest,
        request_id: str,
        metadata: Sequence[tuple[str, Any]],
    ) -> None:
        self._sink = sink
        self._cap = cap  # entity ids kept
        self.at = time.time()  # arrival, for the record's time
        self._t0 = time.perf_counter()
        self._request: gateway_pb2.PredictRequest | None = request
        self.request_id = request_id
        self.metadata = metadata  # the call's incoming metadata: its traceparent, if any
        self.feature_s: float | None = None
        self.inference_s: float | None = None
        # The model inputs the call sent (references), or their hash once too large to hold.
        self.inputs: Mapping[str, np.ndarray] | None = None
        self.input_types: Sequence[TensorType] = ()
        self.feature_hash = ""
        self.feature_count = 0

    def model_inputs(self, types: Sequence[TensorType], inputs: Mapping[str, np.ndarray]) -> None:
        """The feature vector the model is sent (every input tensor in wire layout, and the
        signature's datatypes): kept by reference for the writer, which hashes it (and keeps
        its values for a model with log_features); hashed here when too large to hold."""
        if held_bytes(inputs) > HOLD_BYTES:
            self.feature_hash, self.feature_count = feature_hash(types, inputs)
            return
        self.inputs = inputs
        self.input_types = types

    async def features(self, call: Awaitable[T]) -> T:
        """Await the feature lookups, timing them (also when they fail)."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            self.feature_s = time.perf_counter() - start

    async def inference(self, call: Awaitable[T]) -> T:
        """Await the model call, timing it (also when it fails)."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            self.inference_s = time.perf_counter() - start

    def answered(self, answer: gateway_pb2.PredictResponse) -> gateway_pb2.PredictResponse:
        """Record an answer (also a degraded one) and return it."""
        self._end(answer, "OK", "")
        return answer

    def failed(self, exc: BaseException) -> None:
        """Record the status the caller gets for `exc` (the caller of this re-raises it)."""
        # Errors of the mesh carry their status (services/runtime/errors.py); anything else
        # reaches the caller as INTERNAL, and the log keeps what it was.
        code = getattr(exc, "code", None)
        if isinstance(code, grpc.StatusCode):
            self._end(None, code.name, str(getattr(exc, "message", exc)))
        elif isinstance(exc, asyncio.CancelledError):
            self._end(None, "CANCELLED", "the call was cancelled")
        else:
            self._end(None, "INTERNAL", f"{type(exc).__name__}: {exc}")

    def _end(self, answer: gateway_pb2.PredictResponse | None, status: str, message: str) -> None:
        request = self._request
        if request is None:
            return  # recorded already
        self._request = None
        self.total_s = time.perf_counter() - self._t0
        self.model = request.model
        self.pinned_version = request.version
        # Copies, capped: a request of a thousand rows must not cost a thousand dicts here.
        cap = self._cap
        ids = request.entity_ids
        self.entity_ids = list(ids) if len(ids) <= cap else list(ids[:cap])
        rows = request.entities
        self.entity_rows = [dict(row.ids) for row in rows[:cap]] if rows else []
        self.answer = answer
        self.status = status
        self.message = message
        self._sink(self)


@dataclass
class RowContext:
    """What the writer knows beside the captures: who it is and the current spec's bounds."""

    gateway: str
    gateway_zone: str
    max_output_bytes: int = 1024
    max_entity_ids: int = 64
    max_message_chars: int = 256
    # The entity a model's `entity_ids` name, by model (the shorthand's view's entity).
    entity_of_model: Mapping[str, str] = field(default_factory=dict)
    max_feature_bytes: int = 4096
    # The inputs of each model whose spec sets log_features (the columns' names), by model.
    logged_features: Mapping[str, Mapping[str, ModelInputSpec]] = field(default_factory=dict)


def trace_id_of(metadata: Sequence[tuple[str, Any]]) -> str:
    """The trace id of a W3C traceparent header among `metadata`; "" without a valid one."""
    for key, value in metadata:
        if key == _TRACEPARENT:
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            match = _TRACE_ID.match(text.strip().lower())
            if match and match.group(1) != "0" * 32:
                return match.group(1)
            return ""
    return ""


def to_row(c: PredictWatch, ctx: RowContext) -> Row:
    """The stored row of one capture, in COLUMNS order."""
    entities = _entities(c, ctx)
    answer = c.answer
    message = c.message
    if len(message) > ctx.max_message_chars:
        message = message[: ctx.max_message_chars - 3] + "..."
    return (
        datetime.fromtimestamp(c.at, UTC),
        c.request_id,
        trace_id_of(c.metadata),
        ctx.gateway,
        ctx.gateway_zone,
        c.model[:128],
        (answer.model_version if answer is not None else c.pinned_version)[:128],
        answer.model_replica if answer is not None else "",
        answer.model_zone if answer is not None else "",
        _JSON.encode(entities),
        [f"{name}={i}" for name, ids in entities.items() for i in ids],
        _outputs_json(answer, ctx.max_output_bytes) if answer is not None else "{}",
        None if c.feature_s is None else round(c.feature_s * 1000, 3),
        None if c.inference_s is None else round(c.inference_s * 1000, 3),
        round(c.total_s * 1000, 3),
        c.status,
        message,
        bool(answer is not None and answer.degraded),
        answer.degraded_reason[: ctx.max_message_chars] if answer is not None else "",
        tier_name(answer.tier) if answer is not None else "",
        *_feature_columns(c, ctx),
    )


def _feature_columns(c: PredictWatch, ctx: RowContext) -> tuple[str, int, str | None]:
    """feature_hash, feature_count, features (None: the values are not kept)."""
    inputs = c.inputs
    if inputs is None:
        return c.feature_hash, c.feature_count, None
    digest, count = feature_hash(c.input_types, inputs)
    logged = ctx.logged_features.get(c.model)
    if logged is None:
        return digest, count, None
    return digest, count, features_json(logged, c.input_types, inputs, ctx.max_feature_bytes)


def tier_name(tier: int) -> str:
    """A PredictResponse.tier as the log, the metrics and the CLI write it: "online",
    "cache", "precomputed"."""
    return gateway_pb2.Tier.Name(tier).removeprefix("TIER_").lower()


def _entities(c: PredictWatch, ctx: RowContext) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    kept = 0
    if c.entity_ids:
        name = ctx.entity_of_model.get(c.model, "entity")
        found[name] = [i[:128] for i in c.entity_ids[: ctx.max_entity_ids]]
        kept = len(found[name])
    for row in c.entity_rows[: ctx.max_entity_ids]:
        for name, value in row.items():
            if kept >= ctx.max_entity_ids:
                return found
            ids = found.setdefault(name[:64], [])
            if value[:128] not in ids:
                ids.append(value[:128])
                kept += 1
    return found


def _outputs_json(answer: gateway_pb2.PredictResponse, max_bytes: int) -> str:
    """Each output by name as nested lists in its shape; a tensor too large for the cap keeps
    its shape and its first values; when even that is too large, only the sizes."""
    budget = max(1, max_bytes // 12)  # values a tensor may keep: ~12 bytes each as JSON
    shown: dict[str, Any] = {}
    for name, tensor in sorted(answer.outputs.items()):
        values: list[Any] = []
        for field_name in TENSOR_VALUE_FIELDS:
            held = getattr(tensor, field_name)
            if held:
                values = list(held[:budget])
                count = len(held)
                break
        else:
            count = 0
        values = [_compact(v) for v in values]
        shape = list(tensor.shape)
        if count <= budget and math.prod(shape) == count:
            shown[name] = _nested(values, shape)
        else:
            shown[name] = {"shape": shape, "head": values}
    if not answer.outputs and answer.scores:
        # A fallback answers in scores alone.
        shown["scores"] = [_compact(v) for v in answer.scores[:budget]]
    text = _JSON.encode(shown)
    if len(text) <= max_bytes:
        return text
    sizes = {name: {"shape": list(t.shape)} for name, t in answer.outputs.items()}
    text = _JSON.encode({"truncated": True, "outputs": sizes})
    return text if len(text) <= max_bytes else '{"truncated":true}'


def _compact(value: Any) -> Any:
    # float32 values widened to Python floats print 17 digits; 7 significant are all they hold.
    return float(f"{value:.7g}") if isinstance(value, float) else value


def _nested(values: list[Any], shape: list[int]) -> Any:
    if len(shape) <= 1:
        return values
    step = math.prod(shape[1:])
    return [_nested(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
