"""How a batch of events becomes predictions: through the mesh's edge, or in this process.

Both answer, per event, a `Prediction` or the `Poison` it is (dead-lettered with the
reason), and raise `Transient` for a failure that a later try may not meet (the batch
stays pending and is read again). Which gRPC statuses are which:

    poison     INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, OUT_OF_RANGE
    transient  everything else (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...)

A Predict of many events that answers a poison status is split: each event is asked
alone, so one bad id never takes its batch-mates to the dead-letter stream.

Feature values an event carries are written into its view's current version first
(`FeatureWriter`, straight to the feature store's Redis), so the prediction reads them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np
import redis.asyncio as aioredis

from servemesh.batch.errors import BatchError
from servemesh.contract.wire import TENSOR_VALUE_FIELDS
from servemesh.services.feature.store import (
    LoadInProgress,
    RedisFeatureStore,
    VersionMoved,
    pack_rows,
)
from servemesh.spec import ResolvedSpec, StreamSpec
from servemesh.spec.store_clients import store_writer
from servemesh.state.credentials import EdgeAuthMetadata
from servemesh.streams.events import Event, Poison

POISON_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


class Transient(Exception):
    """A failure worth trying again (the events stay pending); `code` names it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class Prediction:
    """What the output entry of one event holds besides the event's id and entity."""

    model: str
    version: str
    outputs: dict[str, Any]
    degraded: bool = False
    request_id: str = ""


Outcome = Prediction | Poison


class Predictor(Protocol):
    async def predict(self, events: Sequence[Event]) -> list[Outcome]: ...

    async def close(self) -> None: ...


def _rows_of(array: np.ndarray) -> list[Any]:
    rows: list[Any] = array.tolist()
    # One number per row ([n] or [n, 1]) reads as a number.
    return [r[0] if isinstance(r, list) and len(r) == 1 else r for r in rows]


def tensor_rows(tensor: Any) -> list[Any]:
    """A public Tensor's values, one per row."""
    for name in TENSOR_VALUE_FIELDS:
        values = getattr(tensor, name)
        if len(values):
            shape = list(tensor.shape) or [len(values)]
            return _rows_of(np.asarray(list(values)).reshape(shape))
    return [None for _ in range(tensor.shape[0] if tensor.shape else 0)]


class FeatureWriter:
    """Writes the feature values events carry into their views' current versions."""

    def __init__(self, store: RedisFeatureStore, spec: ResolvedSpec, model: str) -> None:
        self.store = store
        self.spec = spec
        self.views = spec.models[model].views

    def entity_of(self, event: Event, view: str) -> str:
        entity = self.spec.entity_of(view)
        if isinstance(event.entity, str):
            return event.entity
        found = event.entity.get(entity)
        if found is None:
            raise Poison(f"entity: names no {entity!r} id (view {view!r} is keyed by it)")
        return found

    async def write(self, events: Sequence[Event]) -> dict[str, Poison]:
        """Write every event's values; the events refused, by id (their rows unwritten)."""
        refused: dict[str, Poison] = {}
        by_view: dict[str, list[tuple[Event, str, dict[str, float]]]] = {}
        for event in events:
            for view, values in event.features.items():
                try:
                    entity = self.entity_of(event, view)
                except Poison as exc:
                    refused[event.id] = exc
                    continue
                by_view.setdefault(view, []).append((event, entity, values))
        for view, rows in by_view.items():
            for _ in range(3):
                version = await self.store.current(view)
                if version is None:
                    for event, _entity, _values in rows:
                        refused[event.id] = Poison(f"features: view {view!r} has no rows yet")
                    break
                ids: list[str] = []
                matrix: list[list[float]] = []
                times: list[int] = []
                for event, entity, values in rows:
                    if event.id in refused:
                        continue
                    unknown = sorted(set(values) - set(version.features))
                    lacking = [f for f in version.features if f not in values]
                    if unknown or lacking:
                        what = (
                            f"not features of {view!r}: {unknown[:5]}"
                            if unknown
                            else (f"a write gives every feature of {view!r}; lacks {lacking[:5]}")
                        )
                        refused[event.id] = Poison(f"features: {what}")
                        continue
                    ids.append(entity)
                    matrix.append([values[f] for f in version.features])
                    times.append(event.event_time_ms)
                if not ids:
                    break
                packed = pack_rows(
                    np.asarray(matrix, dtype=np.float32), np.asarray(times, dtype=np.int64)
                )
                try:
                    await self.store.write_current(version, ids, packed)
                    break
                except VersionMoved:
                    continue
                except LoadInProgress as exc:
                    raise Transient("UNAVAILABLE", str(exc)) from None
            else:
                raise Transient("UNAVAILABLE", f"view {view!r}: its version keeps changing")
        return refused


def feature_store_client(spec: ResolvedSpec) -> aioredis.Redis:
    """A client for writing to the feature store (its primary, followed through a
    failover when replicated)."""
    return store_writer(spec, socket_connect_timeout=2.0)


class MeshPredictor:
    """One Predict per batch through the mesh's edge: routing, canaries, deadlines, the
    prediction log and the gateway's metrics apply as to any caller."""

    def __init__(
        self, spec: ResolvedSpec, stream: StreamSpec, *, address: str | None = None
    ) -> None:
        from servemesh.identity import dial_edges

        self.spec = spec
        self.stream = stream
        # Every zone's edge (round robin, an UNAVAILABLE call retried on another), as any
        # caller; `address` (tests) names one.
        edges = [address] if address else spec.edge_addresses
        self.channel = dial_edges(spec, edges).aio_channel()
        self.auth = EdgeAuthMetadata(spec, f"servemesh-stream:{stream.name}")
        self.timeout_s = stream.deadline_ms / 1000

    async def predict(self, events: Sequence[Event]) -> list[Outcome]:
        from servemesh_api.gateway.v1 import gateway_pb2

        entities = self.spec.entities_of(self._model)
        if len(entities) != 1 and any(isinstance(e.entity, str) for e in events):
            # A bare id names the model's only entity; this model reads several.
            bare = f"entity: a bare id, but model {self.stream.model!r} reads {entities}"
            keep = [e for e in events if not isinstance(e.entity, str)]
            scored = iter(await self.predict(keep) if keep else [])
            return [Poison(bare) if isinstance(e.entity, str) else next(scored) for e in events]
        request = gateway_pb2.PredictRequest(
            model=self.stream.model, version=self.stream.version or ""
        )
        for event in events:
            ids = {entities[0]: event.entity} if isinstance(event.entity, str) else event.entity
            request.entities.add().ids.update(ids)
        try:
            reply = await self._call(request)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code not in POISON_CODES:
                raise Transient(code.name, exc.details() or "") from None
            if len(events) == 1:
                return [Poison(f"{code.name}: {exc.details()}")]
            # Which event is it? Each one alone.
            parts = await asyncio.gather(*(self.predict([e]) for e in events))
            return [outcome for part in parts for outcome in part]
        outputs = {name: tensor_rows(reply.outputs[name]) for name in sorted(reply.outputs)}
        scores = list(reply.scores)
        answers: list[Outcome] = []
        for i in range(len(events)):
            row = {name: values[i] for name, values in outputs.items()}
            if not row and i < len(scores):
                row = {"score": scores[i]}
            answers.append(
                Prediction(
                    model=self.stream.model,
                    version=reply.model_version,
                    outputs=row,
                    degraded=reply.degraded,
                    request_id=reply.request_id,
                )
            )
        return answers

    @property
    def _model(self) -> Any:
        return self.spec.models[self.stream.model]

    async def _call(self, request: Any) -> Any:
        from servemesh_api.gateway.v1 import gateway_pb2_grpc

        stub = gateway_pb2_grpc.GatewayStub(self.channel)
        return await stub.Predict(request, timeout=self.timeout_s, metadata=self.auth.metadata())

    async def close(self) -> None:
        await self.channel.close()


class Score(Protocol):
    """Every output of the model for some rows (float32 matrices by input name), by output
    name; called from a worker thread, one batch at a time."""

    def __call__(self, matrices: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def _check_view_inputs(spec: ResolvedSpec, stream: StreamSpec) -> None:
    inputs = spec.models[stream.model].effective_inputs
    raw = sorted(name for name, source in inputs.items() if source.raw)
    if raw:
        raise ValueError(
            f"stream {stream.name!r}: in_process scores models whose inputs all come "
            f"from views; {stream.model!r} takes raw inputs {raw} (use mode: mesh)"
        )


class InProcessPredictor:
    """Scoring without the mesh's routing: the registry's verified artifact (loaded once,
    in a sandboxed child of this consumer: its own process and user, no secrets, a syscall
    filter; this process, which holds the feature store's password, never runs model code),
    the views read straight from the feature store. No routing, canary or gateway: the
    version is the stream's pin, else the one with the most traffic."""

    def __init__(
        self,
        spec: ResolvedSpec,
        stream: StreamSpec,
        store: RedisFeatureStore,
        score: Score,
        *,
        version: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        close: Callable[[], None] | None = None,
    ) -> None:
        _check_view_inputs(spec, stream)
        inputs = spec.models[stream.model].effective_inputs
        self.spec = spec
        self.stream = stream
        self.store = store
        self.score = score
        self.version = version
        self.inputs = {name: inputs[name] for name in input_names}
        self.output_names = list(output_names)
        self._close = close

    @staticmethod
    def default_version(spec: ResolvedSpec, stream: StreamSpec) -> str:
        if stream.version is not None:
            return stream.version
        traffic = spec.models[stream.model].traffic
        return max(traffic, key=lambda v: (traffic[v], v))

    @classmethod
    async def from_registry(
        cls, spec: ResolvedSpec, stream: StreamSpec, store: RedisFeatureStore
    ) -> InProcessPredictor:
        """Download and verify (sha256) the version from the mesh's registry, and load it
        in a sandboxed child through the model servers' own guard and runner (as a batch
        run does: servemesh.batch.scorer), taking up to the stream's batch size per call."""
        from servemesh.batch.scorer import load_scorer
        from servemesh.contract.wire import message_size_options
        from servemesh.identity import dial_registry

        _check_view_inputs(spec, stream)
        version = cls.default_version(spec, stream)
        options = message_size_options(spec.limits.max_message_bytes)
        async with dial_registry(spec).aio_channel(options=options) as channel:
            scorer = await load_scorer(
                channel, spec, stream.model, version, batch_size=stream.batch_size
            )

        def score(matrices: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return scorer.score_batches(matrices, stream.batch_size)

        return cls(
            spec,
            stream,
            store,
            score,
            version=scorer.version,
            input_names=[t.name for t in scorer.signature.inputs],
            output_names=scorer.output_names,
            close=scorer.close,
        )

    async def predict(self, events: Sequence[Event]) -> list[Outcome]:
        poison: dict[int, Poison] = {}
        matrices: dict[str, np.ndarray] = {}
        for name, source in self.inputs.items():
            assert source.view is not None and source.features is not None
            entity = self.spec.entity_of(source.view)
            ids: list[str] = []
            for i, event in enumerate(events):
                if isinstance(event.entity, str):
                    ids.append(event.entity)
                elif entity in event.entity:
                    ids.append(event.entity[entity])
                else:
                    ids.append("")
                    poison.setdefault(i, Poison(f"entity: names no {entity!r} id"))
            version, rows = await self.store.read(source.view, [i or "-" for i in ids])
            if version is None or rows is None:
                raise Transient("FAILED_PRECONDITION", f"view {source.view!r} has no rows yet")
            try:
                positions = version.positions(source.features)
            except KeyError as exc:
                lacks = f"view {source.view!r} lacks {exc}"
                raise Transient("FAILED_PRECONDITION", lacks) from None
            for i, present in enumerate(rows.present):
                if not present:
                    poison.setdefault(
                        i, Poison(f"NOT_FOUND: entity {ids[i]!r} is not in view {source.view!r}")
                    )
            matrices[name] = np.ascontiguousarray(rows.values[:, positions], dtype=np.float32)
        keep = [i for i in range(len(events)) if i not in poison]
        answers: list[Outcome] = [poison.get(i) or Poison("") for i in range(len(events))]
        if not keep:
            return answers
        kept = {name: m[keep] for name, m in matrices.items()}
        try:
            arrays = await asyncio.to_thread(self.score, kept)
        except BatchError as exc:
            # The model failed its batch or its child died: a later try (a new consumer,
            # a new child) may not; the batch stays pending.
            raise Transient("INTERNAL", str(exc)) from None
        per_output = {name: _rows_of(np.asarray(arrays[name])) for name in self.output_names}
        for j, i in enumerate(keep):
            answers[i] = Prediction(
                model=self.stream.model,
                version=self.version,
                outputs={name: rows[j] for name, rows in per_output.items()},
            )
        return answers

    async def close(self) -> None:
        if self._close is not None:
            self._close()  # the sandboxed child, by its PID
        await self.store.client.aclose()


def encode_outputs(outputs: dict[str, Any]) -> str:
    return json.dumps(outputs, separators=(",", ":"))
