"""Spans in SQLite (WAL): written by the receiver, read by `servemesh trace`, kept within
an age and a size.

One row per span, keyed by (trace id, span id), with the request id and model lifted out
of its attributes so a request id finds its trace through an index; one row per link, so
a trace also finds the spans of other traces that point into it (a model server's batch,
which serves many requests, is a trace of its own linked to each of them).

Retention (`prune`): spans that arrived longer than `max_age_s` ago go first; then, while
the live data is larger than `max_bytes`, the traces that arrived first. Freed pages go
back to the file system (incremental vacuum). The clock is injectable.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from servemesh.contract.private import private_file

# Attribute values are kept as JSON; bound what one span may store.
MAX_ATTRIBUTES_BYTES = 16 * 1024
# Traces deleted per round while the store is over its size.
_PRUNE_BATCH = 200

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id    TEXT NOT NULL,
    span_id     TEXT NOT NULL,
    parent_id   TEXT,
    name        TEXT NOT NULL,
    service     TEXT NOT NULL,
    instance    TEXT,
    kind        INTEGER NOT NULL,
    start_ns    INTEGER NOT NULL,
    end_ns      INTEGER NOT NULL,
    status      TEXT NOT NULL,
    message     TEXT NOT NULL,
    attributes  TEXT NOT NULL,
    request_id  TEXT,
    model       TEXT,
    received_ns INTEGER NOT NULL,
    PRIMARY KEY (trace_id, span_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS spans_by_request ON spans (request_id) WHERE request_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS spans_by_arrival ON spans (received_ns);
CREATE INDEX IF NOT EXISTS spans_by_start ON spans (start_ns);
CREATE TABLE IF NOT EXISTS links (
    trace_id        TEXT NOT NULL,
    span_id         TEXT NOT NULL,
    linked_trace_id TEXT NOT NULL,
    linked_span_id  TEXT NOT NULL,
    PRIMARY KEY (trace_id, span_id, linked_trace_id, linked_span_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS links_by_target ON links (linked_trace_id);
"""

Clock = Callable[[], int]  # nanoseconds since the epoch


@dataclass(frozen=True)
class SpanRecord:
    """One finished span as the store keeps it (ids in lower-case hex)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    kind: int = 0  # OTLP's SpanKind: 1 internal, 2 server, 3 client
    instance: str | None = None
    status: str = "unset"  # unset, ok or error
    message: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    # (trace id, span id) of every span this one links to.
    links: tuple[tuple[str, str], ...] = ()
    request_id: str | None = None
    model: str | None = None

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)

    @property
    def who(self) -> str:
        """The instance that recorded it, else its service."""
        return self.instance or self.service


@dataclass(frozen=True)
class TraceSummary:
    """One trace in a listing: its root span, and what its spans say about the request."""

    trace_id: str
    root_name: str
    root_service: str
    start_ns: int
    duration_ns: int
    request_id: str | None
    model: str | None
    errors: int

    @property
    def status(self) -> str:
        return "error" if self.errors else "ok"


def _attributes_json(attributes: dict[str, Any]) -> str:
    text = json.dumps(attributes, separators=(",", ":"), default=str)
    if len(text) > MAX_ATTRIBUTES_BYTES:
        text = json.dumps({"truncated": True})
    return text


class TraceStore:
    """The SQLite file of one mesh's spans. Thread-safe: one connection behind a lock."""

    def __init__(self, path: Path, *, clock: Clock = time.time_ns) -> None:
        self.path = path
        self.clock = clock
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        # 0600 before SQLite opens it: its -wal and -shm files copy the mode.
        self._db = sqlite3.connect(
            private_file(path), check_same_thread=False, isolation_level=None
        )
        self._db.execute("PRAGMA busy_timeout = 5000")
        # Before the first table: lets prune hand freed pages back (incremental vacuum).
        self._db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        self._db.execute("PRAGMA journal_mode = WAL")
        # WAL with NORMAL sync: a crash loses at most the last spans, never the file.
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- writes ------------------------------------------------------------------------

    def add(self, spans: Iterable[SpanRecord]) -> int:
        """Store `spans` (a span seen again replaces itself); how many were stored."""
        now = self.clock()
        rows = []
        links = []
        for s in spans:
            rows.append(
                (
                    s.trace_id,
                    s.span_id,
                    s.parent_id,
                    s.name,
                    s.service,
                    s.instance,
                    s.kind,
                    s.start_ns,
                    s.end_ns,
                    s.status,
                    s.message,
                    _attributes_json(s.attributes),
                    s.request_id,
                    s.model,
                    now,
                )
            )
            links += [(s.trace_id, s.span_id, t, p) for t, p in s.links]
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO spans VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows
            )
            self._db.executemany("INSERT OR IGNORE INTO links VALUES (?,?,?,?)", links)
        return len(rows)

    def prune(self, max_age_s: float, max_bytes: int) -> int:
        """Apply retention (module docstring); the number of spans deleted."""
        cutoff = self.clock() - int(max_age_s * 1e9)
        deleted = 0
        with self._lock, self._db:
            self._db.execute("BEGIN")
            deleted += self._db.execute(
                "DELETE FROM spans WHERE received_ns < ?", (cutoff,)
            ).rowcount
            while (live := self._live_bytes()) > max_bytes:
                (traces,) = self._db.execute(
                    "SELECT COUNT(DISTINCT trace_id) FROM spans"
                ).fetchone()
                if not traces:
                    break
                # The share of traces the overage is, assuming traces of a like size.
                share = (live - max_bytes) / live
                oldest = self._db.execute(
                    "SELECT trace_id FROM spans GROUP BY trace_id ORDER BY MIN(received_ns) "
                    "LIMIT ?",
                    (max(1, min(_PRUNE_BATCH, math.ceil(traces * share))),),
                ).fetchall()
                deleted += self._db.executemany(
                    "DELETE FROM spans WHERE trace_id = ?", oldest
                ).rowcount
            self._db.execute(
                "DELETE FROM links WHERE NOT EXISTS (SELECT 1 FROM spans s "
                "WHERE s.trace_id = links.trace_id AND s.span_id = links.span_id)"
            )
        with self._lock:
            self._db.execute("PRAGMA incremental_vacuum")
        return deleted

    def _live_bytes(self) -> int:
        (pages,) = self._db.execute("PRAGMA page_count").fetchone()
        (free,) = self._db.execute("PRAGMA freelist_count").fetchone()
        (size,) = self._db.execute("PRAGMA page_size").fetchone()
        return int((pages - free) * size)

    def size_bytes(self) -> int:
        """Bytes the live spans take (the file may hold freed pages until vacuumed)."""
        with self._lock:
            return self._live_bytes()

    # --- reads -------------------------------------------------------------------------

    def count(self) -> int:
        with self._lock:
            (n,) = self._db.execute("SELECT COUNT(*) FROM spans").fetchone()
        return int(n)

    def find(self, ref: str) -> str | None:
        """The trace id of a request id, or `ref` itself when it is a stored trace id."""
        with self._lock:
            row = self._db.execute(
                "SELECT trace_id FROM spans WHERE request_id = ? ORDER BY start_ns LIMIT 1",
                (ref,),
            ).fetchone()
            if row is None:
                row = self._db.execute(
                    "SELECT trace_id FROM spans WHERE trace_id = ? LIMIT 1", (ref.lower(),)
                ).fetchone()
        return str(row[0]) if row else None

    def trace(self, trace_id: str) -> list[SpanRecord]:
        """Every span of the trace, and the spans of other traces linked into it, by start."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM spans WHERE trace_id = ? UNION "
                "SELECT s.* FROM spans s JOIN links l "
                "ON s.trace_id = l.trace_id AND s.span_id = l.span_id "
                "WHERE l.linked_trace_id = ? ORDER BY start_ns",
                (trace_id, trace_id),
            ).fetchall()
            keys = [(r[0], r[1]) for r in rows]
            found: dict[tuple[str, str], list[tuple[str, str]]] = {k: [] for k in keys}
            for chunk in _chunks(keys, 400):
                marks = ",".join("(?,?)" for _ in chunk)
                flat = [v for k in chunk for v in k]
                for t, s, lt, ls in self._db.execute(
                    f"SELECT * FROM links WHERE (trace_id, span_id) IN (VALUES {marks})", flat
                ):
                    found[(t, s)].append((lt, ls))
        return [_record(row, tuple(found[(row[0], row[1])])) for row in rows]

    def slowest(self, limit: int, since_ns: int = 0) -> list[TraceSummary]:
        """The `limit` traces with the longest root span among those started since
        `since_ns`. A root is a span whose parent is not stored (the caller's own span is
        not); a batch's trace, which only serves others (it has links), is not listed."""
        return self._roots(limit, since_ns, "slowest")

    def latest(self, limit: int, since_ns: int = 0) -> list[TraceSummary]:
        """The `limit` traces started last among those started since `since_ns`, newest
        first (roots as `slowest` reads them)."""
        return self._roots(limit, since_ns, "latest")

    def _roots(
        self, limit: int, since_ns: int, order: Literal["slowest", "latest"]
    ) -> list[TraceSummary]:
        by = _ROOT_ORDER[order]
        with self._lock:
            rows = self._db.execute(
                """
                WITH roots AS (
                    SELECT s.trace_id, s.name, COALESCE(s.instance, s.service) AS who,
                           s.start_ns, s.end_ns - s.start_ns AS duration_ns,
                           ROW_NUMBER() OVER (PARTITION BY s.trace_id ORDER BY s.start_ns)
                               AS nth
                    FROM spans s
                    WHERE s.start_ns >= :since
                      AND NOT EXISTS (SELECT 1 FROM spans p
                                      WHERE p.trace_id = s.trace_id AND p.span_id = s.parent_id)
                      AND NOT EXISTS (SELECT 1 FROM links l
                                      WHERE l.trace_id = s.trace_id AND l.span_id = s.span_id)
                )
                SELECT r.trace_id, r.name, r.who, r.start_ns, r.duration_ns,
                       (SELECT MAX(x.request_id) FROM spans x WHERE x.trace_id = r.trace_id),
                       (SELECT MAX(x.model) FROM spans x WHERE x.trace_id = r.trace_id),
                       (SELECT COUNT(*) FROM spans x
                        WHERE x.trace_id = r.trace_id AND x.status = 'error')
                FROM roots r WHERE r.nth = 1
                ORDER BY """
                + by
                + """ LIMIT :limit
                """,
                {"since": since_ns, "limit": limit},
            ).fetchall()
        return [TraceSummary(*row) for row in rows]


# The orders `_roots` lists by (fixed clauses; never a caller's text), trace id last so
# that equal times list the same way every time.
_ROOT_ORDER: dict[str, str] = {
    "slowest": "r.duration_ns DESC, r.trace_id",
    "latest": "r.start_ns DESC, r.trace_id",
}


def _chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _record(row: tuple[Any, ...], links: tuple[tuple[str, str], ...]) -> SpanRecord:
    (
        trace_id,
        span_id,
        parent_id,
        name,
        service,
        instance,
        kind,
        start_ns,
        end_ns,
        status,
        message,
        attributes,
        request_id,
        model,
        _received,
    ) = row
    return SpanRecord(
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent_id,
        name=name,
        service=service,
        instance=instance,
        kind=kind,
        start_ns=start_ns,
        end_ns=end_ns,
        status=status,
        message=message,
        attributes=json.loads(attributes),
        links=links,
        request_id=request_id,
        model=model,
    )
