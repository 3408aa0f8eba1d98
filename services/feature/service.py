"""FeatureService: bulk feature reads, whole-vector writes and all-or-nothing loads of a view.

Reads honour each view's freshness (`feature_views.<view>.max_age` and `staleness` in the
spec): a row older than max_age by its event time is refused (error), answered with the
view's defaults (default), or answered as stored with `stale` set (degraded). Every read,
miss and stale row read is counted per view (services/feature/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import redis.exceptions

from servemesh.contract.echo import brief_list, shown
from servemesh.services.feature.changes import ChangeHub, FeedOverloaded, FeedUnavailable
from servemesh.services.feature.metrics import FeatureMetrics
from servemesh.services.feature.rows import (
    MAX_ID_LENGTH,
    Problem,
    check_event_times,
    check_ids,
    check_values,
    format_age,
)
from servemesh.services.feature.store import (
    CorruptRow,
    LoadInProgress,
    LoadLost,
    RedisFeatureStore,
    Rows,
    StagedLoad,
    StoreError,
    TierRead,
    VersionMoved,
    ViewVersion,
    pack_rows,
)
from servemesh.services.runtime import DeadlineBudget, bind_request_id, request_id_from
from servemesh.services.runtime.deadlines import DeadlineExhausted
from servemesh.services.runtime.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    MeshError,
    NotFound,
    Unavailable,
)
from servemesh.spec import FeatureStoreSpec, FeatureViewSpec, Limits
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

# Checked with fullmatch: `$` would let a trailing newline through.
_VIEW = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
# A model or version name, as the spec spells it.
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
MAX_FEATURE_NAME = 64
MAX_SOURCE_LENGTH = 1024
# Problems one refused load lists; the rest are counted.
MAX_PROBLEMS = 20
# An interrupted load's clean-up: how long the call waits for it, and how long it goes on
# trying a store it cannot reach (a failover names a new primary within seconds; its lease
# would hold the next load off for LOAD_LEASE_MS otherwise).
DISCARD_WAIT_S = 1.0
DISCARD_RETRY_S = 30.0
_LABELS = {feature_pb2.ROW_LABEL_ROW: "row", feature_pb2.ROW_LABEL_LINE: "line"}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class Read:
    """A checked GetFeatures request, its repeated fields taken out once: each access to a
    message's repeated strings makes new str objects (decoded again), and a read uses its
    ids and names several times."""

    view: str
    ids: list[str]
    names: tuple[str, ...]
    packed: bool


def read_of(
    request: feature_pb2.GetFeaturesRequest, max_entities: int, limits: Limits | None = None
) -> Read:
    """The request as a Read; InvalidArgument naming its first bad field. The sizes are
    checked before any element: an oversized request costs no more than that."""
    limits = limits or Limits()
    _check_view(request.view)
    entities, names = len(request.entity_ids), len(request.feature_names)
    if not entities:
        raise InvalidArgument("entity_ids: give at least one entity")
    if entities > max_entities:
        raise InvalidArgument(
            f"entity_ids: {entities} entities, at most {max_entities} per call",
        )
    if not names:
        raise InvalidArgument("feature_names: give at least one feature")
    if names > limits.max_feature_names:
        raise InvalidArgument(
            f"feature_names: {names} names, at most "
            f"{limits.max_feature_names} per call (limits.max_feature_names)"
        )
    cells = entities * names
    if cells > limits.max_feature_cells:
        raise InvalidArgument(
            f"feature_names: {entities} entities x {names} features = {cells} values, at most "
            f"{limits.max_feature_cells} per call (limits.max_feature_cells)"
        )
    # A slice is the quickest way out of a repeated field (one C loop).
    read = Read(
        request.view, request.entity_ids[:], tuple(request.feature_names[:]), request.packed
    )
    _check_ids("entity_ids", read.ids)
    _check_names(read.names)
    return read


@dataclass(frozen=True)
class TierAsk:
    """A checked GetFeaturesRequest.tier."""

    model: str
    version: str
    precomputed: bool


def tier_ask_of(ask: feature_pb2.TierAsk) -> TierAsk:
    """GetFeaturesRequest.tier checked (its entities are the read's, checked with it);
    InvalidArgument naming the bad field."""
    _check_tier_names(ask.model, ask.version, "tier.")
    return TierAsk(ask.model, ask.version, ask.precomputed)


def _check_tier_names(model: str, version: str, prefix: str) -> None:
    for field, value in (("model", model), ("version", version)):
        if not _NAME.fullmatch(value):
            raise InvalidArgument(f"{prefix}{field}: {shown(value)} is not a model or version name")


def tier_message(found: TierRead) -> feature_pb2.GetTierAnswersResponse:
    return feature_pb2.GetTierAnswersResponse(
        flush_generation=found.flush,
        run=found.run,
        sha256=found.sha256,
        scored_at_unix_ms=found.scored_at_ms,
        answers=found.answers,
    )


async def _or_none(read: Coroutine[Any, Any, TierRead]) -> TierRead | None:
    """A tier read whose failure is not the call's: logged, and None."""
    try:
        return await read
    except (StoreError, redis.exceptions.RedisError, OSError) as exc:
        log.debug("tier state unread", extra={"error": str(exc), "kind": type(exc).__name__})
        return None


@functools.lru_cache(maxsize=256)
def _check_names(names: tuple[str, ...]) -> None:
    """feature_names checked once per list of names (callers ask for the same few lists;
    a refused list raises, and is not remembered)."""
    _check_ids("feature_names", names)


def validate_get(
    request: feature_pb2.GetFeaturesRequest, max_entities: int, limits: Limits | None = None
) -> None:
    """Raise InvalidArgument naming the first bad field of a GetFeatures request."""
    read_of(request, max_entities, limits)


def validate_write(request: feature_pb2.WriteFeaturesRequest, max_entities: int) -> None:
    """The request's shape; values are checked against the view by `write_rows`."""
    _check_view(request.view)
    if not request.entities:
        raise InvalidArgument("entities: give at least one entity")
    if len(request.entities) > max_entities:
        raise InvalidArgument(
            f"entities: {len(request.entities)} entities, at most {max_entities} per call",
        )
    for i, entity in enumerate(request.entities):
        _check_id(f"entities[{i}].entity_id", entity.entity_id)
        if not entity.values:
            raise InvalidArgument(f"entities[{i}].values: empty")


def _check_view(view: str) -> None:
    if not _VIEW.fullmatch(view):
        raise InvalidArgument(
            f"view: {shown(view)} is not a view name (lowercase letters, digits, '-' and '_')",
        )


def _check_ids(field: str, values: Sequence[str]) -> None:
    """Every value 1 to MAX_ID_LENGTH characters; the first that is not, named by index.
    Checked in C first (all, max of lengths): a request names up to hundreds of them."""
    if all(values) and max(map(len, values)) <= MAX_ID_LENGTH:
        return
    for i, value in enumerate(values):
        _check_id(f"{field}[{i}]", value)


def _check_id(field: str, value: str) -> None:
    if not value:
        raise InvalidArgument(f"{field}: empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgument(f"{field}: longer than {MAX_ID_LENGTH}")


def _listed(items: Sequence[str]) -> str:
    return brief_list(items)


def positions_of(
    read: Read, view: FeatureViewSpec, version: ViewVersion | None
) -> np.ndarray | None:
    """Where each requested feature sits in a stored row (None: the view has no rows yet).

    InvalidArgument naming the features the view lacks.
    """
    if version is not None:
        try:
            return version.positions(read.names)  # cached per order of names
        except KeyError as exc:
            lacking: list[str] = exc.args[0]
    else:
        known = set(view.features) if view.features is not None else None
        lacking = [n for n in read.names if known is not None and n not in known]
    if lacking:
        which = f"version {version.version} of " if version is not None else ""
        raise InvalidArgument(
            f"feature_names: not features of {which}view {read.view!r}: {_listed(lacking)}"
        )
    return None


def stale_rows(
    rows: Rows | None, view: FeatureViewSpec, now: int, max_age: int | None = None
) -> np.ndarray:
    """Per entity: was its stored row older than the view's max_age at `now`? (`max_age`:
    the view's in ms when the caller has it at hand.)"""
    if max_age is None:
        max_age = view.max_age_ms
    if rows is None or max_age is None:
        return np.zeros(0 if rows is None else len(rows.present), dtype=bool)
    return rows.present & (now - rows.event_ms > max_age)


def assemble(
    read: Read,
    view: FeatureViewSpec,
    policy: FeatureStoreSpec,
    rows: Rows | None,
    positions: np.ndarray | None,
    stale: np.ndarray,
    now: int,
) -> feature_pb2.GetFeaturesResponse:
    """Build the response from stored rows, applying the missing-entity and staleness
    policies (NOT_FOUND / FAILED_PRECONDITION naming the entities, or defaults). With
    `read.packed`, the values go out as one float32 matrix in `packed_values`."""
    ids = read.ids
    present = rows.present if rows is not None else np.zeros(len(ids), dtype=bool)
    every_row = bool(present.all())
    if not every_row and policy.missing_entity == "error":
        missing = [e for e, there in zip(ids, present, strict=True) if not there]
        raise NotFound(f"entity_ids: not in feature view {read.view!r}: {_listed(missing)}")
    any_stale = bool(stale.size and stale.any())
    if any_stale and view.staleness == "error":
        assert rows is not None
        aged = [
            f"{ids[i]} is {format_age(now - int(rows.event_ms[i]))} old"
            for i in np.flatnonzero(stale)
        ]
        raise FailedPrecondition(
            f"entity_ids: stale in feature view {read.view!r} "
            f"(max_age {view.max_age}): {_listed(aged)}"
        )
    # Rows answered with the view's defaults: missing ones, and stale ones under `default`.
    stale_default = any_stale and view.staleness == "default"
    defaulted = ~present | stale if stale_default else ~present
    defaults = (
        [view.defaults.get(n, policy.default_value) for n in read.names]
        if not every_row or stale_default
        else []
    )
    response = feature_pb2.GetFeaturesResponse()
    selected: list[list[float]] | None = None
    if read.packed:
        response.packed_values = _packed(rows, positions, defaulted, defaults, read)
    elif rows is not None and positions is not None:
        selected = rows.values[:, positions].tolist()
    event_ms = rows.event_ms.tolist() if rows is not None else [0] * len(ids)
    flagged = stale.tolist() if any_stale else [False] * len(ids)
    use_defaults = defaulted.tolist() if defaults else [False] * len(ids)
    add = response.vectors.add
    for i, entity_id in enumerate(ids):
        # Fields set one by one, and only when not their default: cheaper than keywords.
        vector = add()
        vector.entity_id = entity_id
        if event_ms[i]:
            vector.event_time_unix_ms = event_ms[i]
        if flagged[i]:
            vector.stale = True
        if use_defaults[i]:
            vector.defaulted = True
            if not read.packed:
                vector.values.extend(defaults)
        elif selected is not None:
            vector.values.extend(selected[i])
    return response


def _packed(
    rows: Rows | None,
    positions: np.ndarray | None,
    defaulted: np.ndarray,
    defaults: list[float],
    read: Read,
) -> bytes:
    """The answer's matrix as packed_values: float32 little-endian, row-major, the
    defaults in the rows answered with them."""
    if rows is not None and positions is not None:
        matrix = rows.values[:, positions]  # a copy: the stored rows stay as read
    else:
        matrix = np.empty((len(read.ids), len(read.names)), dtype=np.float32)
    if defaults:
        matrix[defaulted] = np.asarray(defaults, dtype=np.float32)
    return matrix.astype("<f4", copy=False).tobytes()


def write_rows(
    request: feature_pb2.WriteFeaturesRequest,
    features: Sequence[str],
    view: FeatureViewSpec,
    now: int,
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Entity ids, float32 values in `features` order and event times of a write;
    InvalidArgument naming the entity's field that does not fit the view."""
    wanted = set(features)
    values = np.zeros((len(request.entities), len(features)), dtype=np.float32)
    event_ms = np.zeros(len(request.entities), dtype=np.int64)
    for i, entity in enumerate(request.entities):
        given = set(entity.values)
        unknown = sorted(given - wanted)
        if unknown:
            raise InvalidArgument(
                f"entities[{i}].values: not features of view {request.view!r}: {_listed(unknown)}"
            )
        lacking = [f for f in features if f not in given]
        if lacking:
            raise InvalidArgument(
                f"entities[{i}].values: a write gives every feature of view "
                f"{request.view!r}; lacks {_listed(lacking)}"
            )
        values[i] = [entity.values[f] for f in features]
        event_ms[i] = entity.event_time_unix_ms or now
    for problem in check_values(values, features, view.allow_nan, limit=1):
        raise InvalidArgument(
            f"entities[{problem.row}].values[{problem.column!r}]: {problem.message}"
        )
    for problem in check_event_times(event_ms, now, "event_time_unix_ms", limit=1):
        raise InvalidArgument(f"entities[{problem.row}].event_time_unix_ms: {problem.message}")
    return [e.entity_id for e in request.entities], values, event_ms


def check_header(
    header: feature_pb2.LoadHeader, view: FeatureViewSpec, max_names: int | None = None
) -> list[str]:
    """The load's feature names, checked against the view; InvalidArgument naming the field."""
    names = list(header.feature_names)
    if not names:
        raise InvalidArgument("header.feature_names: give at least one feature")
    max_names = max_names or Limits().max_feature_names
    if len(names) > max_names:
        raise InvalidArgument(
            f"header.feature_names: {len(names)} names, at most {max_names} "
            "(limits.max_feature_names)"
        )
    for i, name in enumerate(names):
        if not name or len(name) > MAX_FEATURE_NAME:
            raise InvalidArgument(
                f"header.feature_names[{i}]: {shown(name)} is not 1 to {MAX_FEATURE_NAME} "
                "characters"
            )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InvalidArgument(f"header.feature_names: named more than once: {_listed(repeated)}")
    if view.features is not None and names != view.features:
        lacking = [f for f in view.features if f not in set(names)]
        unknown = [f for f in names if f not in set(view.features)]
        why = (f"lacks {_listed(lacking)}; " if lacking else "") + (
            f"not features of the view: {_listed(unknown)}; " if unknown else ""
        )
        raise InvalidArgument(
            f"header.feature_names: view {header.view!r} takes its {len(view.features)} "
            f"features in its own order; {why or 'the order differs'}"
        )
    if len(header.source) > MAX_SOURCE_LENGTH:
        raise InvalidArgument(f"header.source: longer than {MAX_SOURCE_LENGTH}")
    return names


def read_chunk(
    chunk: feature_pb2.LoadChunk, width: int, started_ms: int
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A chunk's ids, values (n, width) and event times; InvalidArgument on a bad shape."""
    n = len(chunk.entity_ids)
    expected = n * width * 4
    if len(chunk.values) != expected:
        raise InvalidArgument(
            f"chunk.values: {len(chunk.values)} bytes; {n} rows of {width} float32 "
            f"values take {expected}"
        )
    if chunk.event_times_unix_ms and len(chunk.event_times_unix_ms) != n:
        raise InvalidArgument(
            f"chunk.event_times_unix_ms: {len(chunk.event_times_unix_ms)} times for {n} rows"
        )
    values = np.frombuffer(chunk.values, dtype="<f4").reshape(n, width)
    if chunk.event_times_unix_ms:
        event_ms = np.asarray(chunk.event_times_unix_ms, dtype=np.int64)
    else:
        event_ms = np.full(n, started_ms, dtype=np.int64)
    return list(chunk.entity_ids), values, event_ms


def refuse_rows(problems: list[str], more: bool) -> InvalidArgument:
    """The error a load with bad rows ends with: every problem (up to MAX_PROBLEMS)."""
    shown = problems[:MAX_PROBLEMS]
    tail = " (and more)" if more or len(problems) > MAX_PROBLEMS else ""
    return InvalidArgument(
        f"rows: {len(shown)} problem(s){tail}; nothing was loaded\n  " + "\n  ".join(shown)
    )


def _nobody() -> None:
    pass


@contextlib.contextmanager
def store_statuses(unreachable: Callable[[], None] = _nobody) -> Iterator[None]:
    """Map the store's refusals and Redis failures to the statuses callers see; call
    `unreachable` when Redis could not be reached (the replica's health probes at once)."""
    try:
        yield
    except LoadInProgress as exc:
        raise FailedPrecondition(str(exc)) from None
    except LoadLost as exc:
        raise MeshError(str(exc), code=grpc.StatusCode.ABORTED) from None
    except VersionMoved as exc:
        raise Unavailable(str(exc)) from None
    except CorruptRow as exc:
        raise DataLoss(str(exc)) from None
    except StoreError as exc:
        raise FailedPrecondition(str(exc)) from None
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        # Refused, reset, timed out, or refused our password (AuthenticationError is a
        # ConnectionError): the caller learns only that the store is unavailable.
        log.warning("feature store unreachable", extra={"error": str(exc)})
        unreachable()
        raise Unavailable("feature store unavailable") from None
    except redis.exceptions.RedisError as exc:
        # Redis answered with an error (a script, a type, a permission): a fault of ours,
        # whose text (keys, scripts) stays in the log.
        log.error("feature store error", extra={"error": str(exc), "kind": type(exc).__name__})
        raise Internal("feature store error") from None


class FeatureServicer(feature_pb2_grpc.FeatureServiceServicer):
    def __init__(
        self,
        store: RedisFeatureStore,
        views: Mapping[str, FeatureViewSpec],
        policy: FeatureStoreSpec,
        budget: DeadlineBudget,
        max_entities: int,
        clock: Callable[[], int] = now_ms,
        limits: Limits | None = None,
        metrics: FeatureMetrics | None = None,
        changes: ChangeHub | None = None,
    ) -> None:
        self.store = store
        # Clean-ups of interrupted loads still retrying a store out of reach (_discard).
        self._discarding: set[asyncio.Task[None]] = set()
        # The store's change feed for gateways (WatchChanges); None: not offered.
        self.changes = changes
        self.metrics = metrics or FeatureMetrics()
        # The per-call caps of GetFeatures (feature names, entities x features).
        self.limits = limits or Limits()
        self.views = dict(views)
        self.policy = policy
        self.budget = budget
        self.max_entities = max_entities
        # Milliseconds since the epoch; event times and max_age are measured with it.
        self.clock = clock
        # Called when a store call could not reach Redis (the health watch pokes its probe).
        self.store_unreachable: Callable[[], None] = _nobody
        # Per view name: the view spec last seen and its max_age in ms.
        self._max_ages: dict[str, tuple[FeatureViewSpec, int | None]] = {}

    def _view(self, name: str) -> FeatureViewSpec:
        view = self.views.get(name)
        if view is None:
            raise NotFound(
                f"view: {shown(name)} is not a feature view of this mesh; "
                f"known: {sorted(self.views)}"
            )
        return view

    async def GetFeatures(
        self, request: feature_pb2.GetFeaturesRequest, context: grpc.aio.ServicerContext
    ) -> feature_pb2.GetFeaturesResponse:
        bind_request_id(request_id_from(context.invocation_metadata()))
        read = read_of(request, self.max_entities, self.limits)
        view = self._view(read.view)
        tier = tier_ask_of(request.tier) if request.HasField("tier") else None
        started = time.perf_counter()
        tier_read: TierRead | None = None
        if tier is None:
            max_age = self._max_age_ms(read.view, view)
            version, rows = await self._call_store(
                context, self.store.read(read.view, read.ids, max_age)
            )
        else:
            (version, rows), tier_read = await self._call_store(
                context, self._read_with_tier(read, tier)
            )
        found = int(np.count_nonzero(rows.present)) if rows is not None else 0
        wanted = len(read.ids)
        self.metrics.read(read.view, wanted, wanted - found, time.perf_counter() - started)
        positions = positions_of(read, view, version)
        now = self.clock()
        stale = stale_rows(rows, view, now, self._max_age_ms(read.view, view))
        count = int(np.count_nonzero(stale))
        if count:
            self.metrics.stale_reads.labels(read.view, view.staleness).inc(count)
        response = assemble(read, view, self.policy, rows, positions, stale, now)
        if version is not None:
            response.view_version = version.version  # a gateway's cache keys on it
        if tier_read is not None:
            response.tier.CopyFrom(tier_message(tier_read))
        return response

    async def _read_with_tier(
        self, read: Read, tier: TierAsk
    ) -> tuple[tuple[ViewVersion | None, Rows | None], TierRead | None]:
        """The rows, and the tier state beside them (both Redis round trips at once); the
        tier state is None when it alone could not be read: the caller skips its tiers,
        the rows still answer."""
        ids = read.ids if tier.precomputed else []
        rows, found = await asyncio.gather(
            self.store.read(
                read.view, read.ids, self._max_age_ms(read.view, self._view(read.view))
            ),
            _or_none(self.store.tier_answers(tier.model, tier.version, ids)),
        )
        return rows, found

    async def GetTierAnswers(
        self, request: feature_pb2.GetTierAnswersRequest, context: grpc.aio.ServicerContext
    ) -> feature_pb2.GetTierAnswersResponse:
        bind_request_id(request_id_from(context.invocation_metadata()))
        _check_tier_names(request.model, request.version, "")
        if len(request.entity_ids) > self.max_entities:
            raise InvalidArgument(
                f"entity_ids: {len(request.entity_ids)} ids, at most {self.max_entities} per call"
            )
        _check_ids("entity_ids", request.entity_ids)
        found = await self._call_store(
            context, self.store.tier_answers(request.model, request.version, request.entity_ids)
        )
        return tier_message(found)

    async def WatchChanges(
        self, request: feature_pb2.WatchChangesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[feature_pb2.Changes]:
        if self.changes is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this replica offers no feed")
            return
        try:
            async for message in self.changes.watch():
                yield message
        except FeedUnavailable as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except FeedOverloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (redis.exceptions.RedisError, OSError) as exc:
            self.store_unreachable()
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the feature store's feed broke: {type(exc).__name__}"
            )

    def _max_age_ms(self, name: str, view: FeatureViewSpec) -> int | None:
        """The view's max_age in ms, parsed once per view spec (a spec change brings a new
        FeatureViewSpec object, which is parsed again)."""
        known = self._max_ages.get(name)
        if known is None or known[0] is not view:
            known = self._max_ages[name] = (view, view.max_age_ms)
        return known[1]

    async def WriteFeatures(
        self, request: feature_pb2.WriteFeaturesRequest, context: grpc.aio.ServicerContext
    ) -> feature_pb2.WriteFeaturesResponse:
        bind_request_id(request_id_from(context.invocation_metadata()))
        validate_write(request, self.max_entities)
        view = self._view(request.view)
        written = await self._call_store(context, self._write(request, view))
        return feature_pb2.WriteFeaturesResponse(written=written)

    async def _write(self, request: feature_pb2.WriteFeaturesRequest, view: FeatureViewSpec) -> int:
        """Into the current version; a view without one gets its first version this way."""
        for _ in range(2):
            version = await self.store.current(request.view)
            if version is None and view.features is None:
                raise FailedPrecondition(
                    f"view: {request.view!r} has no rows yet and takes its features from the "
                    "first file loaded into it: load one first (servemesh features load)"
                )
            features = version.features if version is not None else view.features
            assert features is not None
            ids, values, event_ms = write_rows(request, features, view, self.clock())
            if version is None:
                load = await self.store.begin_load(request.view, features, "WriteFeatures")
                try:
                    await load.add(*_last_of_each(ids, values, event_ms))
                    return (await load.commit()).rows
                finally:
                    await load.abort()
            try:
                return await self.store.write_current(version, ids, pack_rows(values, event_ms))
            except VersionMoved:
                continue  # a load swapped meanwhile: write into the new version
        raise Unavailable(f"view {request.view!r}: its version keeps changing; try again")

    async def LoadFeatures(
        self,
        request_iterator: AsyncIterable[feature_pb2.LoadFeaturesRequest],
        context: grpc.aio.ServicerContext,
    ) -> feature_pb2.LoadFeaturesResponse:
        """Header, chunks, commit: the rows become the view's current version at the end of
        the stream, or nothing of them stays (bad rows, a broken stream, no commit)."""
        bind_request_id(request_id_from(context.invocation_metadata()))
        started = time.perf_counter()
        load: StagedLoad | None = None
        try:
            with store_statuses(self.store_unreachable):
                load, committed = await self._receive(request_iterator)
                if not committed:
                    raise InvalidArgument(
                        "commit: the stream ended without one; nothing was loaded"
                    )
                result = await load.commit()
        finally:
            if load is not None and not load.done:
                await self._discard(load)
        log.info(
            "features loaded",
            extra={
                "view": result.view,
                "version": result.version,
                "rows": result.rows,
                "replaced": result.replaced,
                "deleted_keys": result.deleted_keys,
                "replicas_acked": result.replicas_acked,
                "ms": round((time.perf_counter() - started) * 1000, 1),
            },
        )
        return feature_pb2.LoadFeaturesResponse(
            view=result.view,
            version=result.version,
            rows=result.rows,
            entities=result.rows,
            replaced_version=result.replaced,
            deleted_keys=result.deleted_keys,
            replicas_acknowledged=-1 if result.replicas_acked is None else result.replicas_acked,
        )

    async def _receive(
        self, messages: AsyncIterable[feature_pb2.LoadFeaturesRequest]
    ) -> tuple[StagedLoad, bool]:
        """Stage every chunk of the stream; the load and whether a commit ended it."""
        load: StagedLoad | None = None
        view: FeatureViewSpec | None = None
        label = "row"
        committed = False
        started_ms = self.clock()
        try:
            async for message in messages:
                part = message.WhichOneof("part")
                if committed:
                    raise InvalidArgument(f"{part}: sent after the commit; nothing was loaded")
                if load is None:
                    if part != "header":
                        raise InvalidArgument(f"{part}: the stream starts with a header")
                    view = self._view(message.header.view)
                    names = check_header(message.header, view, self.limits.max_feature_names)
                    label = _LABELS.get(message.header.row_label, "row")
                    load = await self.store.begin_load(
                        message.header.view, names, message.header.source
                    )
                elif part == "chunk":
                    assert view is not None
                    await self._stage(load, message.chunk, view, label, started_ms)
                elif part == "commit":
                    if load.rows == 0:
                        raise InvalidArgument(
                            "commit.rows: no rows arrived; a load replaces the whole view, "
                            "so an empty one is refused"
                        )
                    if message.commit.rows != load.rows:
                        raise InvalidArgument(
                            f"commit.rows: {message.commit.rows}, but {load.rows} rows arrived; "
                            "nothing was loaded"
                        )
                    committed = True
                elif part == "header":
                    raise InvalidArgument("header: a second one; nothing was loaded")
                else:
                    raise InvalidArgument("LoadFeaturesRequest: empty; nothing was loaded")
        except BaseException:
            if load is not None:
                await self._discard(load)
            raise
        if load is None:
            raise InvalidArgument("header: the stream ended without one; nothing was loaded")
        return load, committed

    async def _discard(self, load: StagedLoad) -> None:
        """Remove a refused or broken load's staged rows and give its lease back. A task of
        its own, so a caller that hangs up still gets them removed; waited for briefly (it
        takes milliseconds when the store answers), then left to go on: a store out of
        reach (a failover) is tried again for DISCARD_RETRY_S, and the caller hears of the
        failure now instead of after it."""
        task = asyncio.create_task(_quietly(load.abort(retry_for_s=DISCARD_RETRY_S)))
        self._discarding.add(task)
        task.add_done_callback(self._discarding.discard)
        await asyncio.wait({task}, timeout=DISCARD_WAIT_S)

    async def _stage(
        self,
        load: StagedLoad,
        chunk: feature_pb2.LoadChunk,
        view: FeatureViewSpec,
        label: str,
        started_ms: int,
    ) -> None:
        ids, values, event_ms = read_chunk(chunk, len(load.features), started_ms)
        problems: list[Problem] = [
            *check_ids(ids, "key", MAX_PROBLEMS),
            *check_values(values, load.features, view.allow_nan, MAX_PROBLEMS),
            *check_event_times(event_ms, self.clock(), "event time", MAX_PROBLEMS),
        ]
        if not problems:
            for i in await load.add(ids, values, event_ms):
                problems.append(Problem(i, "key", f"{shown(ids[i])} appears more than once"))
        if problems:
            problems.sort(key=lambda p: p.row)
            raise refuse_rows([p.at(label, chunk.first_row) for p in problems], more=False)

    async def _call_store(
        self, context: grpc.aio.ServicerContext, call: Coroutine[Any, Any, T]
    ) -> T:
        """Run a store call inside the caller's deadline; map Redis failures to statuses."""
        try:
            timeout = self.budget.remaining(self.budget.absolute_deadline(context))
        except DeadlineExhausted as exc:
            call.close()
            raise DeadlineExceeded(f"no time left for the store: {exc}") from None
        with store_statuses(self.store_unreachable):
            try:
                # asyncio.timeout, not wait_for: no task of its own for every read.
                async with asyncio.timeout(timeout):
                    return await call
            except TimeoutError:
                raise DeadlineExceeded("feature store did not answer in time") from None


def _last_of_each(
    ids: list[str], values: np.ndarray, event_ms: np.ndarray
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """One row per entity, the last one given (a write's duplicates overwrite)."""
    last = {entity: i for i, entity in enumerate(ids)}
    keep = sorted(last.values())
    return [ids[i] for i in keep], values[keep], event_ms[keep]


async def _quietly(call: Coroutine[Any, Any, None]) -> None:
    """Clean-up that must not replace the error that made it necessary."""
    try:
        await call
    except Exception as exc:  # the original error is what the caller needs to see
        log.warning("could not remove a refused load's rows", extra={"error": str(exc)})
