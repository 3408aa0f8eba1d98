"""Precomputed and cached answers in front of a model's online path (a model's `tiers`).

Pure logic, no network: which calls may use a tier, the version a call would be routed to,
the cache (LRU + TTL, per gateway) and its keys, and answers made from a tier's rows. The
gateway's `Tiers` (services/gateway/tiering.py) puts them together, and its Predict
(services/gateway/service.py) does the reads:

1. precomputed: the version's current batch run (`servemesh batch score --out redis`),
   read by the feature service with the call's features (GetFeaturesRequest.tier: one call
   to the feature service whichever tier answers), used when younger than `max_age`;
2. cache: answers this gateway computed online, keyed by model, version, entity and the
   entity's feature row as the feature service just read it (the view's load version and
   the row's event time), so a changed row misses;
3. online: the model, whose answer then fills the cache.

An answer is only ever served for the version the call would be routed to, computed from
the spec the gateway follows (the sticky bucket's range, or the pinned version). A call
whose version cannot be known (no entity: the weighted split picks per call) goes online.
Each tier's answer rows must all be there (every entity of the call), else the next tier.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from servemesh.predlog.record import tier_name
from servemesh.services.gateway.predict import ModelSignature, PredictPlan, scores_of
from servemesh.services.gateway.tensors import DATATYPES
from servemesh.spec import TiersSpec
from servemesh_api.gateway.v1 import gateway_pb2

# Tier names as the metrics and the prediction log write them.
TIER_NAMES: dict[int, str] = {tier: tier_name(tier) for tier in gateway_pb2.Tier.values()}
# Lookup results the metrics count per tier: `stale` is an answer refused for its age,
# `skipped` a lookup that could not be made (the store unreachable, no time left).
HIT, MISS, STALE, SKIPPED = "hit", "miss", "stale", "skipped"

# One output of one row: datatype, the row's shape, its values (the public field's type).
OutputRow = tuple[str, tuple[int, ...], tuple[float | int | bool, ...]]
# Every output of one row, by name.
RowAnswer = Mapping[str, OutputRow]
# model, version, entity id, the view's version, the row's event time (ms).
CacheKey = tuple[str, str, str, int, int]
# The view version of the keys a cache following the change feed keeps (no row was read, so
# no version or event time): a precomputed answer held in memory, an answer made online.
FEED_PRECOMPUTED, FEED_ONLINE = -2, -1


def tiers_for(plan: PredictPlan) -> TiersSpec | None:
    """The tiers a call may use: the model's, for the shorthand's entity rows alone (no
    caller rows, no raw inputs) and a model nobody shadows (its shadow compares live calls)."""
    tiers = plan.model.tiers
    if tiers is None or (tiers.precomputed is None and tiers.cache is None):
        return None
    if plan.model.inputs is not None or plan.rows.size or plan.raw or plan.model.shadow:
        return None
    if len(plan.reads) != 1 or not plan.reads[0].entity_ids:
        return None
    return tiers


def routed_version(plan: PredictPlan, ranges: Mapping[str, tuple[int, int]]) -> str | None:
    """The version the call goes to: the one it pins, or the one whose bucket range (from
    the weights of the spec followed: wire.bucket_ranges) holds its sticky bucket; None
    when it cannot be known (no entity: the weighted split picks per call)."""
    if plan.version:
        return plan.version
    bucket = plan.bucket
    if bucket is None:
        return None
    for version, (start, end) in ranges.items():
        if start <= bucket < end:
            return version
    return None


def cache_keys(
    model: str,
    version: str,
    entity_ids: Sequence[str],
    view_version: int,
    event_ms: Sequence[int],
) -> list[CacheKey]:
    """Each entity row's key: a load (new view version) or a write (new event time) of the
    row makes a key that was never filled."""
    return [
        (model, version, entity, view_version, int(at))
        for entity, at in zip(entity_ids, event_ms, strict=True)
    ]


def feed_keys(model: str, version: str, entity_ids: Sequence[str], kind: int) -> list[CacheKey]:
    """Each entity's key in a cache that follows the feed (`kind`: FEED_PRECOMPUTED or
    FEED_ONLINE): only a change the feed tells of drops it."""
    return [(model, version, entity, kind, 0) for entity in entity_ids]


class AnswerCache:
    """One model's rows of answers by key, the least recently used dropped beyond
    `max_entries`, each kept `ttl_s` from when it was put. `flush_generation` is the
    model's as last seen: a new one empties the cache."""

    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._rows: OrderedDict[CacheKey, tuple[float, RowAnswer]] = OrderedDict()
        self.flush_generation: int | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def configure(self, max_entries: int, ttl_s: float) -> None:
        """Take a spec change's bounds (a smaller cache drops its oldest rows now)."""
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        while len(self._rows) > max_entries:
            self._rows.popitem(last=False)

    def get_all(self, keys: Sequence[CacheKey]) -> tuple[list[RowAnswer] | None, bool]:
        """Every key's row, or None when one is missing; and whether a missing one was there
        but expired (a stale reject). Hits become the most recently used."""
        now = self.clock()
        found: list[RowAnswer] = []
        rows = self._rows
        for key in keys:
            held = rows.get(key)
            if held is None:
                return None, False
            if now - held[0] >= self.ttl_s:
                del rows[key]
                return None, True
            rows.move_to_end(key)
            found.append(held[1])
        return found, False

    def put_all(self, keys: Sequence[CacheKey], answers: Sequence[RowAnswer]) -> None:
        now = self.clock()
        rows = self._rows
        for key, answer in zip(keys, answers, strict=True):
            rows[key] = (now, answer)
            rows.move_to_end(key)
        while len(rows) > self.max_entries:
            rows.popitem(last=False)

    def drop(self, keys: Sequence[CacheKey]) -> None:
        rows = self._rows
        for key in keys:
            rows.pop(key, None)

    def clear(self) -> None:
        self._rows.clear()

    def flushed(self, generation: int) -> bool:
        """Note the model's flush generation; on a new one (not the first seen) drop every
        row. True when rows were dropped."""
        seen = self.flush_generation
        self.flush_generation = generation
        if seen is None or seen == generation:
            return False
        self._rows.clear()
        return True


def rows_of(response: gateway_pb2.PredictResponse, n_rows: int) -> list[RowAnswer] | None:
    """An online answer cut into one RowAnswer per row; None when it cannot be (an output
    without one row per request row)."""
    per_row: list[dict[str, OutputRow]] = [{} for _ in range(n_rows)]
    for name, tensor in response.outputs.items():
        datatype = DATATYPES.get(tensor.datatype)
        shape = tuple(int(d) for d in tensor.shape)
        if datatype is None or not shape or shape[0] != n_rows:
            return None
        values = getattr(tensor, datatype.public_field)
        width = math.prod(shape[1:])
        if len(values) != width * n_rows:
            return None
        for i in range(n_rows):
            per_row[i][name] = (
                tensor.datatype,
                shape[1:],
                tuple(values[i * width : (i + 1) * width]),
            )
    return list(per_row) if response.outputs else None


def response_of(
    rows: Sequence[RowAnswer], version: str, tier: gateway_pb2.Tier
) -> gateway_pb2.PredictResponse:
    """The answer a tier gives: each output stacked from its rows, `scores` as online."""
    outputs: dict[str, gateway_pb2.Tensor] = {}
    for name, (datatype, shape, _) in rows[0].items():
        tensor = gateway_pb2.Tensor(datatype=datatype, shape=[len(rows), *shape])
        values = getattr(tensor, DATATYPES[datatype].public_field)
        for row in rows:
            values.extend(row[name][2])
        outputs[name] = tensor
    return gateway_pb2.PredictResponse(
        scores=scores_of(outputs, len(rows)),
        outputs=outputs,
        model_version=version,
        tier=tier,
    )


@dataclass(frozen=True)
class TierState:
    """What the feature service read of a model version's tiers beside a call's features."""

    flush_generation: int  # the model's (`servemesh cache flush` raises it)
    scored_at_ms: int  # when the version's current batch run was put in place
    answers: Sequence[bytes]  # the run's stored answer per entity of the call; b"": none


@dataclass(frozen=True)
class Precomputed:
    """What a precomputed lookup found: every row (None when one is missing or unusable),
    and whether the run was refused for its age."""

    rows: list[RowAnswer] | None
    stale: bool = False
    oldest_ms: int = 0  # when the oldest of the rows was scored


def precomputed_rows(
    answers: Sequence[bytes],
    signature: ModelSignature,
    run_scored_at_ms: int,
    now_ms: int,
    max_age_ms: int,
) -> Precomputed:
    """Rows from a batch run's stored answers (JSON {"outputs": {name: [values]},
    "scored_at_ms": ...}), typed and shaped by the model's signature. Refused (stale) when
    the run, or any row, was scored more than `max_age_ms` ago; None rows when an entity
    has no answer or one that does not fit the signature (a miss: the next tier answers)."""
    if not answers or any(not raw for raw in answers):
        return Precomputed(None)
    if now_ms - run_scored_at_ms > max_age_ms:
        return Precomputed(None, stale=True)
    rows: list[RowAnswer] = []
    oldest = run_scored_at_ms
    for raw in answers:
        try:
            stored = json.loads(raw)
            outputs = stored["outputs"]
            scored_at = int(stored.get("scored_at_ms") or run_scored_at_ms)
        except (ValueError, KeyError, TypeError):
            return Precomputed(None)
        if now_ms - scored_at > max_age_ms:
            return Precomputed(None, stale=True)
        oldest = min(oldest, scored_at)
        row = _typed_row(outputs, signature)
        if row is None:
            return Precomputed(None)
        rows.append(row)
    return Precomputed(rows, oldest_ms=oldest)


def _typed_row(outputs: object, signature: ModelSignature) -> RowAnswer | None:
    if not isinstance(outputs, dict) or set(outputs) != {t.name for t in signature.outputs}:
        return None
    row: dict[str, OutputRow] = {}
    for meta in signature.outputs:
        values = _flat(outputs[meta.name])
        if values is None:
            return None
        shape = tuple(meta.shape[1:])
        if any(d < 0 for d in shape):
            shape = (len(values),) if shape else ()
        if math.prod(shape) != len(values):
            return None
        kind = DATATYPES[meta.datatype].public.kind
        cast: type = bool if kind == "b" else int if kind in "iu" else float
        try:
            row[meta.name] = (meta.datatype, shape, tuple(cast(v) for v in values))
        except (TypeError, ValueError):
            return None
    return row


def _flat(value: object) -> list[object] | None:
    """A nested list's values in row-major order; a lone number as one value."""
    if isinstance(value, list):
        flat: list[object] = []
        for item in value:
            inner = _flat(item)
            if inner is None:
                return None
            flat += inner
        return flat
    if isinstance(value, (int, float, bool)):
        return [value]
    return None
