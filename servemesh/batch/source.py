"""What a batch run reads: the ids to score, and their rows in a feature view version
pinned for the whole run.

The rows are read with the online store's own layout (services/feature/store.py): one
MGET per chunk of the entities' keys under the pinned version, with the view's pointer key
last. A version's keys are deleted only after it stopped being current, so while the
pointer still names the pinned version every value came from it; once a load replaced the
view the run stops (`SourceChanged`) rather than mix two versions in one output.

The ids of a view are every key of its pinned version (SCAN, bounded steps), sorted: the
same order on every run of the same version, which is what lets `--resume` continue at a
chunk index.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis import Redis

from servemesh.batch.errors import BatchError, SourceChanged
from servemesh.services.feature.store import (
    RedisFeatureStore,
    Rows,
    ViewVersion,
    unpack_rows,
)


@dataclass(frozen=True)
class PinnedView:
    """One view at the version a run reads from start to end."""

    version: ViewVersion
    pointer: str  # the view's `current` key, read last in every MGET

    @property
    def view(self) -> str:
        return self.version.view


async def pin_view(store: RedisFeatureStore, view: str, version: int | None = None) -> PinnedView:
    """The view's current version (or `version`, which must still be current: a resumed
    run); BatchError when the view holds nothing, SourceChanged when `version` is gone."""
    current = await store.refresh(view)
    if current is None:
        raise BatchError(f"--view {view}: the view holds no rows; load it first")
    if version is not None and current.version != version:
        raise SourceChanged(
            f"view {view!r} is at version {current.version}, the interrupted run read version "
            f"{version}: its rows are gone; start the run again without --resume"
        )
    return PinnedView(current, store.view_key(view, "current"))


# Keys per MGET. Redis answers one command at a time: an MGET of a whole chunk (16,384 keys,
# about 4 MB for the demo view) holds every other client of the store, the feature
# services' online reads among them, for several milliseconds. Slices of this size keep
# that wait under a millisecond for a few more round trips per chunk.
READ_SLICE = 2048
# Keys Redis looks at per SCAN page while listing a view's entities (a page holds its other
# clients about as long as a READ_SLICE read).
SCAN_COUNT = 4096


async def view_entity_ids(store: RedisFeatureStore, pinned: PinnedView) -> list[str]:
    """Every entity of the pinned version, sorted (bytes order of their UTF-8 ids)."""
    base = pinned.version.key_base.encode()
    pattern = store._version_pattern(pinned.view, pinned.version.version)
    found: list[bytes] = []
    cut = len(base)
    cursor = 0
    # Page by page, not key by key (scan_iter's async generator costs about a microsecond
    # a key): the listing runs before the first chunk is read, so nothing hides it.
    while True:
        cursor, keys = await store.client.scan(cursor, match=pattern, count=SCAN_COUNT)
        found += [k[cut:] if isinstance(k, bytes) else str(k).encode()[cut:] for k in keys]
        if cursor == 0:
            break
    found.sort()
    # The run must not start from a version a load replaced while it was being listed.
    await check_current(store.client, pinned)
    return [entity.decode() for entity in found]


async def check_current(client: aioredis.Redis, pinned: PinnedView) -> None:
    raw = await client.get(pinned.pointer)
    if raw is None or int(raw) != pinned.version.version:
        raise SourceChanged(_replaced(pinned, raw))


def _replaced(pinned: PinnedView, raw: object) -> str:
    now = raw.decode() if isinstance(raw, bytes) else str(raw)
    return (
        f"view {pinned.view!r} was replaced during the run (version {pinned.version.version} "
        f"-> {now}); the output is not written: run it again"
    )


async def read_rows(client: aioredis.Redis, pinned: PinnedView, entity_ids: Sequence[str]) -> Rows:
    """The rows of `entity_ids` in the pinned version: an MGET per READ_SLICE ids, each with
    the pointer key last."""
    slices = _sliced(pinned, entity_ids)
    return _joined([_decode(pinned, await _mget(client, keys)) for keys in slices])


async def _mget(client: aioredis.Redis, keys: Sequence[str]) -> list[Any]:
    """client.mget(keys), sent as packed by `packed_mget`, on one of the client's pooled
    connections (already authenticated, as for any command)."""
    pool = client.connection_pool
    connection = await pool.get_connection()
    try:
        await connection.send_packed_command(packed_mget(keys))
        answer = await connection.read_response()
    except BaseException:
        # Cancelled or failed between the command and its whole reply: the connection may
        # hold the rest of the reply, so it is not used again.
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)
    return list(answer)


def packed_mget(keys: Sequence[str]) -> bytes:
    """MGET `keys` in Redis's protocol (RESP). redis-py packs a command in Python argument by
    argument (type checks, an encode and concatenations for each one): for the thousands of
    keys of a chunk that was two fifths of a batch run's interpreter time, while the model
    waited for the reads in the other thread."""
    encoded = [key.encode() for key in keys]
    return b"*%d\r\n$4\r\nMGET\r\n%s" % (
        len(encoded) + 1,
        b"".join([b"$%d\r\n%s\r\n" % (len(key), key) for key in encoded]),
    )


def read_rows_sync(client: Redis, pinned: PinnedView, entity_ids: Sequence[str]) -> Rows:
    """`read_rows` with a blocking client (a distributed run's workers)."""
    return _joined([_decode(pinned, client.mget(keys)) for keys in _sliced(pinned, entity_ids)])


def _sliced(pinned: PinnedView, entity_ids: Sequence[str]) -> list[list[str]]:
    """The keys of one MGET per READ_SLICE ids, each with the pointer key last; one (with
    the pointer alone) for no ids, so even an empty read checks the version."""
    return [
        _keys(pinned, entity_ids[start : start + READ_SLICE])
        for start in range(0, max(len(entity_ids), 1), READ_SLICE)
    ]


def _joined(parts: Sequence[Rows]) -> Rows:
    """The rows of consecutive reads as one read's."""
    if len(parts) == 1:
        return parts[0]
    return Rows(
        present=np.concatenate([p.present for p in parts]),
        event_ms=np.concatenate([p.event_ms for p in parts]),
        values=np.concatenate([p.values for p in parts]),
    )


def _keys(pinned: PinnedView, entity_ids: Sequence[str]) -> list[str]:
    base = pinned.version.key_base
    return [*(base + e for e in entity_ids), pinned.pointer]


def _decode(pinned: PinnedView, answer: Sequence[Any]) -> Rows:
    *stored, raw = answer
    if raw is None or int(raw) != pinned.version.version:
        raise SourceChanged(_replaced(pinned, raw))
    rows = [v if v is None or isinstance(v, bytes) else None for v in stored]
    return unpack_rows(rows, len(pinned.version.features))


@dataclass(frozen=True)
class EntityFile:
    """The ids in a CSV or Parquet file's column, in file order, and the file's digest."""

    ids: list[str]
    sha256: str
    column: str


def read_entity_file(path: Path, column: str | None, entity: str) -> EntityFile:
    """The ids of `column` (default: the entity's name, else the file's first column);
    BatchError naming the file and the problem (no such column, an empty or repeated id)."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    if not path.is_file():
        raise BatchError(f"--entities {path}: no such file")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    suffixes = [s.lower() for s in path.suffixes]
    try:
        if ".parquet" in suffixes or ".pq" in suffixes:
            table = pq.read_table(path)
        else:
            # Ids are text: never let the CSV reader turn "007" into 7.
            table = pa_csv.read_csv(
                path,
                convert_options=pa_csv.ConvertOptions(column_types={column or entity: pa.string()}),
            )
    except (pa.ArrowInvalid, OSError) as exc:
        raise BatchError(f"--entities {path}: unreadable: {str(exc).splitlines()[0]}") from None
    if not table.num_columns:
        raise BatchError(f"--entities {path}: no columns")
    name = column or (entity if entity in table.column_names else table.column_names[0])
    if name not in table.column_names:
        raise BatchError(
            f"--entities {path}: no column {name!r}; columns: {', '.join(table.column_names)}"
        )
    values = table.column(name).to_pylist()
    ids: list[str] = []
    seen: dict[str, int] = {}
    for row, value in enumerate(values):
        text = "" if value is None else str(value)
        if not text:
            raise BatchError(f"--entities {path}: row {row} of column {name!r} has no id")
        if text in seen:
            raise BatchError(
                f"--entities {path}: id {text!r} is in rows {seen[text]} and {row} of "
                f"column {name!r}; each entity is scored once"
            )
        seen[text] = row
        ids.append(text)
    return EntityFile(ids, digest, name)


def features_matrix(rows: Rows, pinned: PinnedView, features: Sequence[str]) -> np.ndarray:
    """The float32 (n, len(features)) matrix of `features`, in that order."""
    positions = pinned.version.positions(features)
    return np.ascontiguousarray(rows.values[:, positions], dtype=np.float32)
