"""The Redis online store: one packed value per entity, under numbered versions of a view.

A view is replaced as a whole: a load writes every row under a new version, then one
pointer swap makes that version the one readers read, then the versions before it are
deleted. Readers never see half a load. This module is the one place that knows the keys
(prefix `fs`, view `user`):

| key | type | what |
| --- | --- | --- |
| `fs:user:current` | string | the version readers read |
| `fs:user:seq` | string | the last version number handed out (INCR) |
| `fs:user:load` | string | lease of the load in progress (its version); expires unless renewed |
| `fs:user:versions` | set | versions whose keys may exist: staged, current, being deleted |
| `fs:user@7` | hash | version 7's metadata: features (JSON list), source, rows, times |
| `fs:user@7:<entity>` | string | the entity's row: event time, then its values |

A row is `<q` (int64 little-endian, the event time in ms since the Unix epoch) followed by
one `<f4` (float32 little-endian) per feature of the version, in the version's order: one
GET per entity, no parsing beyond a numpy view of the bytes.

Readers cache each view's current version. A read is one MGET of the entities' keys with
the pointer key last: if the pointer still names the cached version, every value came from
that version while it was current (a version's keys are deleted only after it stopped
being current, and MGET is atomic); otherwise the reader takes the new version's metadata
and reads again. So a swap is seen by the first read that starts after it, at the cost of
one more key per MGET, and never a half-deleted version.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import redis.asyncio as aioredis
import redis.exceptions
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from servemesh.contract.errors import ServemeshError
from servemesh.contract.tier_keys import flush_key, score_keys
from servemesh.services.runtime.tracing import tracer

# A load that sends nothing for this long loses its lease; the next load cleans up after it.
LOAD_LEASE_MS = 60_000
# How often an interrupted load's clean-up tries a store it cannot reach again.
ABORT_RETRY_EVERY_S = 0.5
# Keys per SCAN step and per UNLINK when a version is deleted: bounded work per round trip.
DELETE_BATCH = 1000
# How often a read retries when the pointer moves under it before giving up.
READ_ATTEMPTS = 3
# What a read takes for "this side of a replicated store cannot be reached" (the other side
# is asked then): refused, reset, timed out.
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
# What a read on either side of a replicated store answers (RedisFeatureStore._from_either).
T = TypeVar("T")

_EVENT_TIME = np.dtype("<i8")
_VALUE = np.dtype("<f4")
_GLOB_SPECIALS = str.maketrans({c: f"\\{c}" for c in "*?[]\\"})

# Renew the lease only while this load holds it: KEYS[1] lease, ARGV[1] version, ARGV[2] ms.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# The swap: KEYS[1] lease, KEYS[2] pointer, KEYS[3] metadata; ARGV[1] version, ARGV[2]
# rows, ARGV[3] now (ms). Only the lease holder swaps; answers the replaced version or -1.
_SWAP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local old = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[3], 'rows', ARGV[2], 'committed_at_ms', ARGV[3])
if old then return tonumber(old) end
return 0
"""
# Release a lease this load holds: KEYS[1] lease, ARGV[1] version.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Overwrite rows of the current version: KEYS[1] pointer, KEYS[2] lease, KEYS[3..] rows;
# ARGV[1] version, ARGV[2..] values. -1: not the current version; -2: a load is running.
_WRITE_CURRENT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -2 end
for i = 3, #KEYS do redis.call('SET', KEYS[i], ARGV[i - 1]) end
return #KEYS - 2
"""


class StoreError(ServemeshError):
    """Base of the store's refusals; each names the view."""


class LoadInProgress(StoreError):
    """Another load of the view holds its lease."""


class LoadLost(StoreError):
    """This load's lease expired and it may no longer swap."""


class VersionMoved(StoreError):
    """The view's current version changed under a write or a read, more than it retries."""


class CorruptRow(StoreError):
    """A stored value or version record does not have the layout this module writes."""


@dataclass(frozen=True)
class ViewVersion:
    """One version of a view, as readers see it."""

    view: str
    version: int
    features: tuple[str, ...]
    # An entity's key is this followed by its id ("fs:user@7:"): one concatenation a key.
    key_base: str = field(compare=False, repr=False)
    _positions: dict[tuple[str, ...], np.ndarray] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def row_bytes(self) -> int:
        return _EVENT_TIME.itemsize + 4 * len(self.features)

    def positions(self, names: Sequence[str]) -> np.ndarray:
        """Indices of `names` in a stored row; KeyError listing the names it lacks."""
        key = tuple(names)
        found = self._positions.get(key)
        if found is None:
            index = {name: i for i, name in enumerate(self.features)}
            lacking = [name for name in key if name not in index]
            if lacking:
                raise KeyError(lacking)
            found = np.array([index[name] for name in key], dtype=np.intp)
            if len(self._positions) < 64:  # callers ask for a handful of orders
                self._positions[key] = found
        return found


@dataclass(frozen=True)
class Rows:
    """Decoded rows: per requested entity, whether it was there, its event time, its values."""

    present: np.ndarray  # bool (n,)
    event_ms: np.ndarray  # int64 (n,), 0 where absent
    values: np.ndarray  # float32 (n, features), 0 where absent


@dataclass(frozen=True)
class TierRead:
    """A model version's precomputed answers for some entities and the model's flush
    generation (servemesh/contract/tier_keys.py)."""

    flush: int
    run: int  # the version's current batch run; 0: none
    sha256: str
    scored_at_ms: int
    answers: list[bytes]  # per entity, as stored; b"" when the run has none


@dataclass(frozen=True)
class LoadResult:
    view: str
    version: int
    rows: int
    replaced: int  # 0: the view had no version
    deleted_keys: int
    # A replicated store: how many replicas had every row and the swap when the load was
    # acknowledged (None: a single Redis, nothing to wait for). 0 means the wait timed out:
    # the load is current on the primary, and a failover right now could lose it.
    replicas_acked: int | None = None


def pack_rows(values: np.ndarray, event_ms: np.ndarray) -> list[bytes]:
    """Stored bytes of each row: the event time, then the float32 values."""
    n, width = values.shape
    record = np.dtype([("t", _EVENT_TIME), ("v", "<f4", (width,))])
    packed = np.empty(n, dtype=record)
    packed["t"] = event_ms
    packed["v"] = values
    raw = packed.tobytes()
    size = record.itemsize
    return [raw[i * size : (i + 1) * size] for i in range(n)]


@functools.lru_cache(maxsize=256)
def _record(width: int) -> np.dtype:
    """A stored row's layout for `width` features (built once per width: a structured
    dtype costs more to make than a small read costs to decode)."""
    return np.dtype([("t", _EVENT_TIME), ("v", "<f4", (width,))])


def unpack_rows(stored: Sequence[bytes | None], width: int) -> Rows:
    """Decode stored rows of a version with `width` features; CorruptRow on a bad length.

    When every row is there (the usual read), the arrays are read-only views of one
    buffer holding the stored bytes, not copies."""
    record = _record(width)
    found = [v for v in stored if v is not None]
    for v in found:
        if len(v) != record.itemsize:
            raise CorruptRow(
                f"a stored row is {len(v)} bytes, its version's layout is {record.itemsize}"
            )
    if found and len(found) == len(stored):
        # Two strided views of one buffer (cheaper than a structured array's fields).
        joined = b"".join(found)
        n, size = len(found), record.itemsize
        return Rows(
            present=np.ones(n, dtype=bool),
            event_ms=np.ndarray((n,), _EVENT_TIME, joined, 0, (size,)),
            values=np.ndarray((n, width), _VALUE, joined, _EVENT_TIME.itemsize, (size, 4)),
        )
    present = np.array([v is not None for v in stored], dtype=bool)
    event_ms = np.zeros(len(stored), dtype=np.int64)
    values = np.zeros((len(stored), width), dtype=np.float32)
    if found:
        decoded = np.frombuffer(b"".join(found), dtype=record)
        event_ms[present] = decoded["t"]
        values[present] = decoded["v"]
    return Rows(present=present, event_ms=event_ms, values=values)


def _redis_span(command: str, keys: int) -> AbstractContextManager[Span | None]:
    """A client span around one Redis read (current, so errors mark it), when the read
    serves a recorded span; none otherwise (an unsampled call carries no span at all)."""
    if not trace.get_current_span().is_recording():
        return nullcontext()
    return tracer().start_as_current_span(
        f"redis {command}",
        kind=SpanKind.CLIENT,
        attributes={"db.system": "redis", "db.operation": command, "db.redis.keys": keys},
    )


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# How long a replicated store's load waits for a replica to hold it before it is
# acknowledged all the same (saying no replica did): well within the writer's socket
# timeout (5 s, services/feature/replica.py), which would otherwise end the wait as an error.
LOAD_ACK_TIMEOUT_MS = 2000


class RedisFeatureStore:
    """Reads, writes and loads views; every read is one MGET round trip."""

    def __init__(
        self,
        client: aioredis.Redis,
        key_prefix: str = "fs",
        *,
        reader: aioredis.Redis | None = None,
        lag_s: Callable[[], float] | None = None,
        load_ack_replicas: int = 0,
        load_ack_timeout_ms: int = LOAD_ACK_TIMEOUT_MS,
    ) -> None:
        # `client` writes (a replicated store's primary, found through Sentinel); `reader`,
        # when given, answers reads (the zone's replica) while its lag, `lag_s()`, is
        # within the view's max_age.
        self.client = client
        self.reader = reader or client
        self.lag_s = lag_s
        # A load is acknowledged once this many replicas hold it (WAIT), at most this long:
        # replication is asynchronous, and a primary lost right after a commit would take
        # an acknowledged load with it.
        self.load_ack_replicas = load_ack_replicas
        self.load_ack_timeout_ms = load_ack_timeout_ms
        self.key_prefix = key_prefix
        self._cached: dict[str, ViewVersion | None] = {}
        self._renew = client.register_script(_RENEW)
        self._swap = client.register_script(_SWAP)
        self._release = client.register_script(_RELEASE)
        self._write_current = client.register_script(_WRITE_CURRENT)

    # --- keys ---------------------------------------------------------------------------

    def view_key(self, view: str, what: str) -> str:
        """`current`, `seq`, `load` or `versions` of a view."""
        return f"{self.key_prefix}:{view}:{what}"

    def version_key(self, view: str, version: int) -> str:
        """The metadata hash of one version."""
        return f"{self.key_prefix}:{view}@{version}"

    def entity_key(self, view: str, version: int, entity_id: str) -> str:
        return f"{self.version_key(view, version)}:{entity_id}"

    def _version_pattern(self, view: str, version: int) -> str:
        return f"{self.version_key(view, version).translate(_GLOB_SPECIALS)}:*"

    # --- reads --------------------------------------------------------------------------

    async def current(self, view: str) -> ViewVersion | None:
        """The view's current version (cached; `refresh` re-reads the pointer)."""
        if view not in self._cached:
            await self.refresh(view)
        return self._cached[view]

    async def refresh(
        self, view: str, version: int | None = None, client: aioredis.Redis | None = None
    ) -> ViewVersion | None:
        """Re-read the view's pointer (or take `version`) and that version's metadata
        (from `client`; the reader by default)."""
        client = client or self.reader
        if version is None:
            with _redis_span("GET", 1):
                raw = await client.get(self.view_key(view, "current"))
            version = int(raw) if raw is not None else 0
        found = await self._version(view, version, client) if version else None
        self._cached[view] = found
        return found

    async def _version(self, view: str, version: int, client: aioredis.Redis) -> ViewVersion | None:
        with _redis_span("HGET", 1):
            meta = await client.hget(self.version_key(view, version), "features")
        if meta is None:
            return None  # deleted meanwhile: the caller reads the pointer again
        try:
            features = json.loads(meta)
        except ValueError:
            raise CorruptRow(f"view {view!r} version {version}: unreadable feature list") from None
        return ViewVersion(
            view=view,
            version=version,
            features=tuple(features),
            key_base=self.entity_key(view, version, ""),
        )

    def reads_primary(self, max_age_ms: int | None) -> bool:
        """Whether a read of a view with `max_age_ms` goes to the primary: the replica's
        lag is past the view's max age (rows fresh on the primary could read stale)."""
        if self.reader is self.client or self.lag_s is None or max_age_ms is None:
            return False
        return self.lag_s() * 1000 > max_age_ms

    async def read(
        self, view: str, entity_ids: Sequence[str], max_age_ms: int | None = None
    ) -> tuple[ViewVersion | None, Rows | None]:
        """The rows of `entity_ids` in the view's current version, and that version.

        (None, None) when the view has no version yet. From the replica, unless its lag is
        past `max_age_ms`; from the other side when the first cannot be reached.
        """
        first = self.client if self.reads_primary(max_age_ms) else self.reader
        return await self._from_either(first, lambda c: self._read(view, entity_ids, c))

    async def _from_either(
        self, first: aioredis.Redis, read: Callable[[aioredis.Redis], Awaitable[T]]
    ) -> T:
        """`read` from `first`, else, when it cannot be reached, from the other side of a
        replicated store. The zone's replica lost: the primary's rows (fresher, never
        staler). No primary (a failover under way): the replica's rows, whose event times
        still decide their staleness."""
        second = self.client if first is self.reader else self.reader
        try:
            return await read(first)
        except _UNREACHABLE:
            if first is second:
                raise
            return await read(second)

    async def _read(
        self, view: str, entity_ids: Sequence[str], client: aioredis.Redis
    ) -> tuple[ViewVersion | None, Rows | None]:
        pointer = self.view_key(view, "current")
        cached = (
            self._cached[view] if view in self._cached else await self.refresh(view, None, client)
        )
        for _ in range(READ_ATTEMPTS):
            version = cached.version if cached else 0
            keys = [cached.key_base + e for e in entity_ids] if cached else []
            with _redis_span("MGET", len(keys) + 1):
                answer: Sequence[bytes | str | None] = await client.mget([*keys, pointer])
            *stored, raw = answer
            now = int(raw) if raw is not None else 0
            # The client answers bytes (no decode_responses); anything else is not ours.
            rows = [v if v is None or isinstance(v, bytes) else None for v in stored]
            if now == version:
                if cached is None:
                    return None, None
                return cached, unpack_rows(rows, len(cached.features))
            cached = await self.refresh(view, now, client)
        raise VersionMoved(f"view {view!r}: its version changed {READ_ATTEMPTS} times in one read")

    async def tier_answers(self, model: str, version: str, entity_ids: Sequence[str]) -> TierRead:
        """The flush generation of `model`, and the answers of the current batch run of
        `model` `version` for `entity_ids`: read with the run pointer last (as a view's rows
        are), so every answer is from the run that was current while it was read."""
        return await self._from_either(
            self.reader, lambda c: self._tier_answers(model, version, entity_ids, c)
        )

    async def _tier_answers(
        self, model: str, version: str, entity_ids: Sequence[str], reader: aioredis.Redis
    ) -> TierRead:
        keys = score_keys(self.key_prefix, model, version)
        pointer = keys.current
        with _redis_span("MGET", 2):
            flushed = flush_key(self.key_prefix, model)
            flush_raw, run_raw = await reader.mget([flushed, pointer])
        flush = int(flush_raw or 0)
        for _ in range(READ_ATTEMPTS):
            run = int(run_raw or 0)
            if not run or not entity_ids:
                return TierRead(flush, run, "", 0, [])
            run_key = keys.run(run)
            with _redis_span("MGET", len(entity_ids) + 1):
                async with reader.pipeline(transaction=False) as pipe:
                    pipe.hmget(run_key, ["sha256", "scored_at_ms"])
                    pipe.mget([*(keys.answer(run, e) for e in entity_ids), pointer])
                    meta, values = await pipe.execute()
            *stored, run_raw = values
            if int(run_raw or 0) == run:
                sha256, scored_at = meta
                return TierRead(
                    flush,
                    run,
                    sha256.decode() if isinstance(sha256, bytes) else "",
                    int(scored_at or 0),
                    [v if isinstance(v, bytes) else b"" for v in stored],
                )
        raise VersionMoved(f"{keys.base}: its run changed {READ_ATTEMPTS} times in one read")

    # --- writes into the current version ------------------------------------------------

    async def write_current(
        self, version: ViewVersion, entity_ids: Sequence[str], rows: Sequence[bytes]
    ) -> int:
        """Overwrite rows of `version`, which must still be current and not being replaced.

        VersionMoved when another version is current now; LoadInProgress during a load.
        """
        view = version.view
        keys = [self.view_key(view, "current"), self.view_key(view, "load")]
        keys += [self.entity_key(view, version.version, e) for e in entity_ids]
        answer = int(await self._write_current(keys=keys, args=[version.version, *rows]))
        if answer == -1:
            await self.refresh(view)
            raise VersionMoved(f"view {view!r}: version {version.version} is no longer current")
        if answer == -2:
            raise LoadInProgress(f"view {view!r}: a load is replacing it; write after it ends")
        return answer

    # --- loads --------------------------------------------------------------------------

    async def begin_load(
        self, view: str, features: Sequence[str], source: str, lease_ms: int = LOAD_LEASE_MS
    ) -> StagedLoad:
        """Take the view's load lease and open a new version for rows.

        LoadInProgress when another load holds the lease. Versions left behind by loads
        that died are deleted first (nobody else writes while the lease is held).
        """
        version = int(await self.client.incr(self.view_key(view, "seq")))
        lease = self.view_key(view, "load")
        if not await self.client.set(lease, version, nx=True, px=lease_ms):
            holder = await self.client.get(lease)
            shown = holder.decode() if isinstance(holder, bytes) else holder
            raise LoadInProgress(
                f"view {view!r}: another load (version {shown}) is running; try again when it ends"
            )
        try:
            current = await self.client.get(self.view_key(view, "current"))
            current_version = int(current) if current is not None else 0
            for leftover in await self._versions(view):
                if leftover != current_version:
                    await self.drop_version(view, leftover)
            await self.client.sadd(self.view_key(view, "versions"), version)
            await self.client.hset(
                self.version_key(view, version),
                mapping={
                    "features": json.dumps(list(features)),
                    "source": source,
                    "started_at_ms": _now_ms(),
                },
            )
        except BaseException:
            await self._release(keys=[lease], args=[version])
            raise
        return StagedLoad(self, view, version, tuple(features), lease_ms)

    async def _versions(self, view: str) -> list[int]:
        members = await self.client.smembers(self.view_key(view, "versions"))
        return sorted(int(m) for m in members)

    async def drop_version(self, view: str, version: int) -> int:
        """Delete a version's rows and record in bounded batches; how many rows went."""
        deleted = 0
        batch: list[bytes] = []
        async for key in self.client.scan_iter(
            match=self._version_pattern(view, version), count=DELETE_BATCH
        ):
            batch.append(key)
            if len(batch) >= DELETE_BATCH:
                deleted += int(await self.client.unlink(*batch))
                batch = []
        if batch:
            deleted += int(await self.client.unlink(*batch))
        await self.client.unlink(self.version_key(view, version))
        await self.client.srem(self.view_key(view, "versions"), version)
        return deleted

    def _remember(self, view: str, version: ViewVersion) -> None:
        self._cached[view] = version


class StagedLoad:
    """Rows of a new version, invisible to readers until `commit`; `abort` removes them."""

    def __init__(
        self,
        store: RedisFeatureStore,
        view: str,
        version: int,
        features: tuple[str, ...],
        lease_ms: int,
    ) -> None:
        self.store = store
        self.view = view
        self.version = version
        self.features = features
        self.lease_ms = lease_ms
        self.rows = 0
        self.done = False

    async def add(
        self, entity_ids: Sequence[str], values: np.ndarray, event_ms: np.ndarray
    ) -> list[int]:
        """Stage rows (float32 values, int64 event times), all of them or none.

        Returns the positions, in this call, of rows whose entity is already staged or
        comes twice in the call; when there are any, nothing of the call was written.
        """
        if self.done:
            raise StoreError(f"view {self.view!r}: version {self.version} is already finished")
        store = self.store
        keys = [store.entity_key(self.view, self.version, e) for e in entity_ids]
        first: dict[str, int] = {}
        repeated = [i for i, key in enumerate(keys) if first.setdefault(key, i) != i]
        if not repeated:
            lease = store.view_key(self.view, "load")
            async with store.client.pipeline(transaction=False) as pipe:
                # One MSETNX per call: sets every key, or none when any exists already.
                pipe.msetnx(dict(zip(keys, pack_rows(values, event_ms), strict=True)))
                # Renewed with every call: a load that stops sending loses its lease.
                await store._renew(keys=[lease], args=[self.version, self.lease_ms], client=pipe)
                written, renewed = await pipe.execute()
            if not renewed:
                raise LoadLost(
                    f"view {self.view!r}: the load of version {self.version} lost its lease "
                    f"(nothing sent for {self.lease_ms / 1000:.0f} s, or another load took over)"
                )
            if written:
                self.rows += len(keys)
                return []
        async with store.client.pipeline(transaction=False) as pipe:
            for key in first:
                pipe.exists(key)
            there = await pipe.execute()
        staged = [first[key] for key, found in zip(first, there, strict=True) if found]
        return sorted({*repeated, *staged})

    async def commit(self) -> LoadResult:
        """Make this version current in one step, then delete every version before it."""
        store = self.store
        keys = [
            store.view_key(self.view, "load"),
            store.view_key(self.view, "current"),
            store.version_key(self.view, self.version),
        ]
        acked: int | None = None
        args = [self.version, self.rows, _now_ms()]
        if store.load_ack_replicas > 0:
            # WAIT on the swap's own connection: a replica that acknowledged the swap's
            # offset holds every row staged before it too (one ordered replication stream).
            async with store.client.pipeline(transaction=False) as pipe:
                await store._swap(keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", store.load_ack_replicas, store.load_ack_timeout_ms)
                swapped, waited = await pipe.execute()
            replaced, acked = int(swapped), int(waited)
        else:
            replaced = int(await store._swap(keys=keys, args=args))
        if replaced < 0:
            raise LoadLost(
                f"view {self.view!r}: the load of version {self.version} lost its lease "
                "before its commit; nothing was swapped"
            )
        self.done = True
        store._remember(
            self.view,
            ViewVersion(
                self.view,
                self.version,
                self.features,
                key_base=store.entity_key(self.view, self.version, ""),
            ),
        )
        deleted = 0
        # Only older versions: a newer one is a load that began after this swap.
        for old in await store._versions(self.view):
            if old < self.version:
                deleted += await store.drop_version(self.view, old)
        return LoadResult(self.view, self.version, self.rows, replaced, deleted, acked)

    async def abort(self, *, retry_for_s: float = 0.0) -> None:
        """Remove everything staged and give the lease back; the current version stays.

        `retry_for_s`: a store that cannot be reached (a failover under way: no primary, or
        one being demoted) is tried again every half second for this long. Without it, the
        lease of a load the primary's loss interrupted holds every next load off until it
        expires (LOAD_LEASE_MS)."""
        if self.done:
            return
        self.done = True
        store = self.store
        deadline = time.monotonic() + retry_for_s
        while True:
            try:
                await store.drop_version(self.view, self.version)
                await store._release(keys=[store.view_key(self.view, "load")], args=[self.version])
                return
            except (
                redis.exceptions.ConnectionError,
                redis.exceptions.TimeoutError,
                redis.exceptions.ReadOnlyError,
                OSError,
            ):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(ABORT_RETRY_EVERY_S)
