"""Questions to the prediction log: one `LogQuery`, answered by DuckDB over the Parquet
files or by PostgreSQL, with the same filters and the same rows."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import duckdb

from servemesh.predlog.buffer import STATUS_FILE, predictions_dir
from servemesh.predlog.features import parse_features
from servemesh.predlog.parquet_store import SCHEMA, expire_files, live_files
from servemesh.predlog.record import COLUMNS
from servemesh.spec import PredictionLogSpec
from servemesh.spec.durations import duration_seconds

_SINCE = re.compile(r"^(\d+(ms|s|m|h|d))+$")


def parse_since(text: str) -> float:
    """`5m`, `1h`, `1d`, `1h30m` as seconds; ValueError naming --since otherwise."""
    if not _SINCE.match(text) or duration_seconds(text) <= 0:
        raise ValueError(f"--since {text!r}: give a duration such as 5m, 1h, 1d or 1h30m")
    return duration_seconds(text)


def parse_slowest(text: str) -> tuple[float | None, int | None]:
    """`--slowest 1%` (a share of the matching calls) or `--slowest 20` (a count)."""
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if 0 < share <= 100:
                return share, None
        elif int(text) > 0:
            return None, int(text)
    except ValueError:
        pass
    raise ValueError(f"--slowest {text!r}: give a percentage (1%) or a count (20)")


def parse_entity(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise ValueError(f"--entity {text[:60]!r}: give name=id, e.g. customer=c-17")
    return name.strip(), value.strip()


@dataclass(frozen=True)
class LogQuery:
    since_s: float = 3600.0
    slowest_share: float | None = None  # percent of the matching calls, slowest first
    slowest_count: int | None = None
    entities: tuple[tuple[str, str], ...] = ()
    errors: bool = False  # status other than OK
    degraded: bool = False  # answered from a fallback or from stale features
    tier: str | None = None  # answered by this tier (online, cache, precomputed)
    model: str | None = None
    version: str | None = None
    request_id: str | None = None
    trace_id: str | None = None
    limit: int = 50


@dataclass
class QueryResult:
    rows: list[dict[str, Any]]
    matched: int  # calls matching the filters (before --slowest and --limit)
    selected: int  # what --slowest selects of them (== matched without it)


@dataclass
class LogSummary:
    store: str
    files: int | None
    rows: int
    oldest: datetime | None
    newest: datetime | None
    gateways: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TopEntities:
    """The entities a model's calls named most, by calls: (id, calls) most first, and the
    calls naming one of the entity's ids in all (what a share is of)."""

    rows: list[tuple[str, int]]
    calls: int
    distinct: int  # how many ids were named at all


# One query per dialect: the entity keys ("user=user-42") of the model's calls since a time,
# counted per key (most first, then by id), with the total and the distinct count.
_TOP_SQL = """
WITH keys AS (
    SELECT k FROM (SELECT unnest(entity_keys) AS k FROM {source} WHERE ts >= {mark}
                   AND model = {mark}) AS named
    WHERE left(k, {mark}) = {mark}
), counted AS (SELECT k, count(*) AS n FROM keys GROUP BY k)
SELECT k, n, (SELECT sum(n) FROM counted), (SELECT count(*) FROM counted)
FROM counted ORDER BY n DESC, k LIMIT {mark}
"""


# Calls per hour since a time (UTC hours), oldest first: what a forecast learns from.
_HOURLY_SQL = """
SELECT date_trunc('hour', ts) AS hour, count(*) FROM {source}
WHERE ts >= {mark} GROUP BY hour ORDER BY hour
"""


def _hourly(
    execute: Callable[[str, list[Any]], list[tuple[Any, ...]]],
    source: str,
    mark: str,
    since: datetime,
) -> list[tuple[datetime, int]]:
    found = execute(_HOURLY_SQL.format(source=source, mark=mark), [since])
    return [(_utc(hour), int(n)) for hour, n in found]


@dataclass
class FeatureRecords:
    """A model's calls over a window and the feature values the log kept of them."""

    values: list[dict[str, list[Any]]]  # each record's values by feature, newest first
    calls: int  # the model's calls in the window
    with_values: int  # how many of them kept their values (log_features)


# The kept values of one model's (and version's) newest calls since a time, and the counts.
_FEATURES_SQL = """
SELECT features FROM {source}
WHERE ts >= {mark} AND model = {mark} AND features IS NOT NULL{version}
ORDER BY ts DESC LIMIT {mark}
"""
_FEATURE_CALLS_SQL = """
SELECT count(*), count(features) FROM {source} WHERE ts >= {mark} AND model = {mark}{version}
"""


def _features(
    execute: Callable[[str, list[Any]], list[tuple[Any, ...]]],
    source: str,
    mark: str,
    model: str,
    version: str | None,
    since: datetime,
    limit: int,
) -> FeatureRecords:
    where = f" AND version = {mark}" if version else ""
    params: list[Any] = [since, model, *([version] if version else [])]
    counted = execute(_FEATURE_CALLS_SQL.format(source=source, mark=mark, version=where), params)
    calls, with_values = (int(n or 0) for n in counted[0]) if counted else (0, 0)
    found = execute(_FEATURES_SQL.format(source=source, mark=mark, version=where), [*params, limit])
    return FeatureRecords([parse_features(value) for (value,) in found], calls, with_values)


def _utc(value: Any) -> datetime:
    """An hour as DuckDB (naive, or in the session's zone) or PostgreSQL (aware) gives it."""
    if not isinstance(value, datetime):
        raise TypeError(f"not a time: {value!r}")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _top(
    execute: Callable[[str, list[Any]], list[tuple[Any, ...]]],
    source: str,
    mark: str,
    model: str,
    entity: str,
    since: datetime,
    limit: int,
) -> TopEntities:
    prefix = f"{entity}="
    found = execute(
        _TOP_SQL.format(source=source, mark=mark),
        [since, model, len(prefix), prefix, limit],
    )
    if not found:
        return TopEntities([], 0, 0)
    rows = [(str(k)[len(prefix) :], int(n)) for k, n, _, _ in found]
    return TopEntities(rows, int(found[0][2]), int(found[0][3]))


def _filters(q: LogQuery, now: float, mark: str, entity_sql: str) -> tuple[str, list[Any]]:
    """The WHERE clause and its parameters; `mark` is the dialect's placeholder."""
    clauses = [f"ts >= {mark}"]
    params: list[Any] = [datetime.fromtimestamp(now - q.since_s, UTC)]
    for name, ident in q.entities:
        clauses.append(entity_sql)
        params.append(f"{name}={ident}")
    if q.errors:
        clauses.append("status <> 'OK'")
    if q.degraded:
        clauses.append("degraded")
    chosen: tuple[tuple[str, str | None], ...] = (
        ("model", q.model),
        ("version", q.version),
        ("request_id", q.request_id),
        ("trace_id", q.trace_id),
        ("tier", q.tier),
    )
    for column, value in chosen:
        if value is not None:
            clauses.append(f"{column} = {mark}")
            params.append(value)
    return " AND ".join(clauses), params


def _answer(
    q: LogQuery,
    execute: Callable[[str, list[Any]], list[tuple[Any, ...]]],
    source: str,
    where: str,
    params: list[Any],
    mark: str,
) -> QueryResult:
    columns = ", ".join(COLUMNS)
    matched = int(execute(f"SELECT count(*) FROM {source} WHERE {where}", params)[0][0])
    if q.slowest_share is not None or q.slowest_count is not None:
        if q.slowest_share is not None:
            # Nearest rank: the slowest 1% of 250 calls is 3 calls (never 0 of a few).
            selected = min(matched, math.ceil(matched * q.slowest_share / 100))
        else:
            selected = min(matched, q.slowest_count or 0)
        order = "total_ms DESC, ts DESC"
    else:
        selected = matched
        order = "ts DESC"
    shown = min(selected, q.limit)
    found = execute(
        f"SELECT {columns} FROM {source} WHERE {where} ORDER BY {order} LIMIT {mark}",
        [*params, shown],
    )
    rows = [dict(zip(COLUMNS, values, strict=True)) for values in found]
    for row in rows:
        for key in ("entities", "outputs"):
            # jsonb comes back parsed, Parquet's text does not: readers get one shape.
            if isinstance(row[key], str):
                row[key] = json.loads(row[key])
        row["entity_keys"] = list(row["entity_keys"] or [])
        # Null in files written before the columns.
        row["tier"] = row["tier"] or ""
        row["feature_hash"] = row["feature_hash"] or ""
        row["feature_count"] = int(row["feature_count"] or 0)
        if isinstance(row["features"], str):
            row["features"] = json.loads(row["features"])
    return QueryResult(rows, matched, selected)


# Every gateway's files as one table (a file list is bound as the first parameter). The
# log's own schema, empty, comes first: a column that none of the files holds (all written
# before it existed) reads as null rather than failing the query.
LOG_SCHEMA_TABLE = "log_schema"
PARQUET_SOURCE = (
    f"(SELECT * FROM {LOG_SCHEMA_TABLE} UNION ALL BY NAME "
    "SELECT * FROM read_parquet(?, union_by_name = true))"
)
# Listings a read may take when compaction removes files under it.
READ_ATTEMPTS = 5
_T = TypeVar("_T")


def _duckdb() -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB that knows the log's schema (PARQUET_SOURCE reads it)."""
    con = duckdb.connect()
    con.register(LOG_SCHEMA_TABLE, SCHEMA.empty_table())
    return con


def _over_files(
    files: list[str],
    answer: Callable[[Callable[[str, list[Any]], list[tuple[Any, ...]]]], _T],
    utc: bool,
) -> _T:
    with _duckdb() as con:
        if utc:
            con.execute("SET TimeZone = 'UTC'")

        def execute(text: str, args: list[Any]) -> list[tuple[Any, ...]]:
            return con.execute(text, [files, *args]).fetchall()

        return answer(execute)


class ParquetReader:
    """DuckDB over every gateway's files (in memory: it holds no database file)."""

    def __init__(self, root: Path, clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.clock = clock

    def expire(self, retention_s: float) -> int:
        return expire_files(self.root, int((self.clock() - retention_s) * 1000))

    def _listed(self, since_ms: int | None, read: Callable[[list[str]], _T], empty: _T) -> _T:
        """`read(files)` of the files live since `since_ms` (every file: None; `empty` when
        there are none).
        A writer's compaction may remove files between the listing and the read (it renames
        their merged file in first): the read is then made again on a new listing."""
        for attempt in range(READ_ATTEMPTS):
            files = [str(f.path) for f in live_files(self.root, since_ms)]
            if not files:
                return empty
            try:
                return read(files)
            except duckdb.IOException:
                gone = [f for f in files if not Path(f).exists()]
                if not gone or attempt == READ_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _read(
        self,
        since_ms: int,
        answer: Callable[[Callable[[str, list[Any]], list[tuple[Any, ...]]]], _T],
        empty: _T,
        *,
        utc: bool = False,
    ) -> _T:
        """`answer(execute)` over the files live since `since_ms` (see `_listed`)."""
        return self._listed(since_ms, lambda files: _over_files(files, answer, utc), empty)

    def query(self, q: LogQuery) -> QueryResult:
        now = self.clock()
        where, params = _filters(q, now, "?", "list_contains(entity_keys, ?)")
        return self._read(
            int((now - q.since_s) * 1000),
            lambda execute: _answer(q, execute, PARQUET_SOURCE, where, params, "?"),
            QueryResult([], 0, 0),
        )

    def top_entities(self, model: str, entity: str, since_s: float, limit: int) -> TopEntities:
        """The `limit` ids of `entity` that `model`'s calls of the last `since_s` named most."""
        now = self.clock()
        since = datetime.fromtimestamp(now - since_s, UTC)
        return self._read(
            int((now - since_s) * 1000),
            lambda execute: _top(execute, PARQUET_SOURCE, "?", model, entity, since, limit),
            TopEntities([], 0, 0),
        )

    def feature_records(
        self, model: str, version: str | None, since_s: float, limit: int
    ) -> FeatureRecords:
        """The feature values kept of `model`'s (`version`'s) newest `limit` calls of the
        last `since_s`, and how many calls there were."""
        now = self.clock()
        since = datetime.fromtimestamp(now - since_s, UTC)
        return self._read(
            int((now - since_s) * 1000),
            lambda execute: _features(execute, PARQUET_SOURCE, "?", model, version, since, limit),
            FeatureRecords([], 0, 0),
        )

    def hourly_calls(self, since_s: float) -> list[tuple[datetime, int]]:
        """Every gateway's calls per UTC hour over the last `since_s`, oldest first."""
        now = self.clock()
        since = datetime.fromtimestamp(now - since_s, UTC)
        return self._read(
            int((now - since_s) * 1000),
            lambda execute: _hourly(execute, PARQUET_SOURCE, "?", since),
            [],
            utc=True,
        )

    def summary(self) -> LogSummary:
        """How many files and rows, and their time span (`servemesh log status`)."""
        where = f"parquet files under {self.root}"

        def counted(files: list[str]) -> LogSummary:
            with _duckdb() as con:
                found = con.execute(
                    f"SELECT count(*), min(ts), max(ts) FROM {PARQUET_SOURCE}", [files]
                ).fetchone()
            assert found is not None
            return LogSummary(where, len(files), int(found[0]), found[1], found[2], [])

        return self._listed(None, counted, LogSummary(where, 0, 0, None, None, []))


class PostgresReader:
    def __init__(self, dsn: str, table: str, clock: Callable[[], float] = time.time) -> None:
        self.dsn = dsn
        self.table = table
        self.clock = clock

    def expire(self, retention_s: float) -> int:
        from servemesh.predlog.postgres_store import connect, delete_before

        with connect(self.dsn) as conn:
            return delete_before(conn, self.table, int((self.clock() - retention_s) * 1000))

    def query(self, q: LogQuery) -> QueryResult:
        from psycopg import sql

        from servemesh.predlog.postgres_store import connect

        now = self.clock()
        # The GIN index on entity_keys answers containment.
        where, params = _filters(q, now, "%s", "entity_keys @> ARRAY[%s]::text[]")
        source = sql.Identifier(self.table).as_string(None)
        with connect(self.dsn) as conn:

            def execute(text: str, args: list[Any]) -> list[tuple[Any, ...]]:
                return conn.execute(text.encode(), args).fetchall()

            return _answer(q, execute, source, where, params, "%s")

    def top_entities(self, model: str, entity: str, since_s: float, limit: int) -> TopEntities:
        """As ParquetReader.top_entities, in PostgreSQL."""
        from psycopg import sql

        from servemesh.predlog.postgres_store import connect

        since = datetime.fromtimestamp(self.clock() - since_s, UTC)
        source = sql.Identifier(self.table).as_string(None)
        with connect(self.dsn) as conn:

            def execute(text: str, args: list[Any]) -> list[tuple[Any, ...]]:
                return conn.execute(text.encode(), args).fetchall()

            return _top(execute, source, "%s", model, entity, since, limit)

    def feature_records(
        self, model: str, version: str | None, since_s: float, limit: int
    ) -> FeatureRecords:
        """As ParquetReader.feature_records, in PostgreSQL."""
        from psycopg import sql

        from servemesh.predlog.postgres_store import connect

        since = datetime.fromtimestamp(self.clock() - since_s, UTC)
        source = sql.Identifier(self.table).as_string(None)
        with connect(self.dsn) as conn:

            def execute(text: str, args: list[Any]) -> list[tuple[Any, ...]]:
                return conn.execute(text.encode(), args).fetchall()

            return _features(execute, source, "%s", model, version, since, limit)

    def hourly_calls(self, since_s: float) -> list[tuple[datetime, int]]:
        """As ParquetReader.hourly_calls, in PostgreSQL (hours truncated in UTC)."""
        from psycopg import sql

        from servemesh.predlog.postgres_store import connect

        since = datetime.fromtimestamp(self.clock() - since_s, UTC)
        source = sql.Identifier(self.table).as_string(None)
        with connect(self.dsn) as conn:
            conn.execute("SET TIME ZONE 'UTC'")

            def execute(text: str, args: list[Any]) -> list[tuple[Any, ...]]:
                return conn.execute(text.encode(), args).fetchall()

            return _hourly(execute, source, "%s", since)

    def summary(self) -> LogSummary:
        from psycopg import sql

        from servemesh.predlog.postgres_store import connect

        with connect(self.dsn) as conn:
            found = conn.execute(
                sql.SQL("SELECT count(*), min(ts), max(ts) FROM {}").format(
                    sql.Identifier(self.table)
                )
            ).fetchone()
        assert found is not None
        return LogSummary(
            f"postgres table {self.table}",
            None,
            int(found[0]),
            found[1],
            found[2],
            [],
        )


def reader_for(
    settings: PredictionLogSpec, state_dir: str | Path, clock: Callable[[], float] = time.time
) -> ParquetReader | PostgresReader:
    dsn = settings.dsn()
    if dsn is not None:
        return PostgresReader(dsn, settings.postgres_table, clock)
    return ParquetReader(predictions_dir(state_dir), clock)


def gateway_status(state_dir: str | Path) -> list[dict[str, Any]]:
    """Each gateway's last written counters (its status file), by gateway name."""
    root = predictions_dir(state_dir)
    found: list[dict[str, Any]] = []
    for path in sorted(root.glob(f"*/{STATUS_FILE}")) if root.is_dir() else []:
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced right now, or not ours
    return found
