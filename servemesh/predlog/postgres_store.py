"""The PostgreSQL store: one table every gateway writes with COPY, created when missing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from servemesh.predlog.record import COLUMNS, Row

# Column types, in COLUMNS order.
_TYPES = (
    "timestamptz NOT NULL",
    "text NOT NULL",
    "text NOT NULL",
    "text NOT NULL",
    "text NOT NULL",
    "text NOT NULL",
    "text NOT NULL",
    "text NOT NULL",
    "text NOT NULL",
    "jsonb NOT NULL",
    "text[] NOT NULL",
    "jsonb NOT NULL",
    "double precision",
    "double precision",
    "double precision NOT NULL",
    "text NOT NULL",
    "text NOT NULL",
    "boolean NOT NULL",
    "text NOT NULL",
    "text NOT NULL DEFAULT ''",
    "text NOT NULL DEFAULT ''",
    "bigint NOT NULL DEFAULT 0",
    "jsonb",
)
# Columns added after the first release: a table made before them gains them in place.
_ADDED = ("tier", "feature_hash", "feature_count", "features")
assert len(_TYPES) == len(COLUMNS)

# Index name suffix -> (method, columns): time ranges, entity lookups, errors, one request.
_INDEXES = {
    "ts": ("btree", ("ts",)),
    "entity_keys": ("gin", ("entity_keys",)),
    "status": ("btree", ("status", "ts")),
    "request_id": ("btree", ("request_id",)),
}


def connect(dsn: str) -> psycopg.Connection[tuple[Any, ...]]:
    # Short connect timeout: a writer thread must not hang on a dead server for minutes.
    return psycopg.connect(dsn, connect_timeout=5, autocommit=True)


def ensure_table(conn: psycopg.Connection[tuple[Any, ...]], table: str) -> None:
    """Create the table and its indexes when missing (several writers may race: one wins)."""
    columns = sql.SQL(", ").join(
        sql.SQL("{} {}").format(sql.Identifier(name), sql.SQL(kind))
        for name, kind in zip(COLUMNS, _TYPES, strict=True)
    )
    statements = [
        sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(sql.Identifier(table), columns)
    ]
    kinds = dict(zip(COLUMNS, _TYPES, strict=True))
    for name in _ADDED:
        statements.append(
            sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                sql.Identifier(table), sql.Identifier(name), sql.SQL(kinds[name])
            )
        )
    for suffix, (method, cols) in _INDEXES.items():
        statements.append(
            sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} USING {} ({})").format(
                sql.Identifier(f"{table}_{suffix}"),
                sql.Identifier(table),
                sql.SQL(method),
                sql.SQL(", ").join(sql.Identifier(c) for c in cols),
            )
        )
    for attempt in range(2):
        try:
            with conn.transaction():
                for statement in statements:
                    conn.execute(statement)
            return
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
            # Another writer created it between our check and our create.
            if attempt:
                raise


def delete_before(conn: psycopg.Connection[tuple[Any, ...]], table: str, before_ms: int) -> int:
    cursor = conn.execute(
        sql.SQL("DELETE FROM {} WHERE ts < %s").format(sql.Identifier(table)),
        (datetime.fromtimestamp(before_ms / 1000, UTC),),
    )
    return cursor.rowcount


class PostgresStore:
    """The writer of one gateway instance: batches go in with COPY on one connection,
    opened again after a failure."""

    kind = "postgres"

    def __init__(self, dsn: str, table: str) -> None:
        self.dsn = dsn
        self.table = table
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None

    def describe(self) -> str:
        return f"postgres table {self.table}"

    def _connection(self) -> psycopg.Connection[tuple[Any, ...]]:
        if self._conn is None or self._conn.closed:
            conn = connect(self.dsn)
            try:
                ensure_table(conn, self.table)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def write(self, rows: Sequence[Row]) -> None:
        if not rows:
            return
        conn = self._connection()
        copy = sql.SQL("COPY {} ({}) FROM STDIN").format(
            sql.Identifier(self.table), sql.SQL(", ").join(sql.Identifier(c) for c in COLUMNS)
        )
        try:
            with conn.transaction(), conn.cursor() as cursor, cursor.copy(copy) as out:
                for row in rows:
                    out.write_row(row)
        except psycopg.Error:
            # The connection may be the broken part: the next batch opens a new one.
            self.close()
            raise

    def compact(self) -> None:
        pass

    def expire(self, before_ms: int) -> int:
        try:
            return delete_before(self._connection(), self.table, before_ms)
        except psycopg.Error:
            self.close()
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def json_value(value: object) -> object:
    """jsonb comes back parsed; the Parquet side keeps JSON text: readers see one shape."""
    return json.dumps(value, separators=(",", ":")) if isinstance(value, dict | list) else value
