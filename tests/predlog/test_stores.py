"""Both stores answer the same questions with the same rows: Parquet files read by DuckDB,
and a real PostgreSQL started for the session (a table of its own per test, dropped after)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

import psycopg
import pyarrow.parquet as pq
import pytest
from psycopg import sql

from servemesh.predlog.features import feature_hash
from servemesh.predlog.parquet_store import MERGE_RUN, ParquetStore, instance_files, live_files
from servemesh.predlog.postgres_store import PostgresStore
from servemesh.predlog.query import LogQuery, ParquetReader, PostgresReader
from servemesh.predlog.record import COLUMNS, Row
from servemesh_api.gateway.v1 import gateway_pb2
from tests.postgres_server import PostgresServer
from tests.predlog.records import LOGGED, TYPES, row, vector

NOW = 1_800_000_000.0  # 2027-01-15 08:00 UTC


@dataclass
class Backend:
    store: ParquetStore | PostgresStore
    reader: ParquetReader | PostgresReader


@pytest.fixture
def dsn(postgres: PostgresServer) -> str:
    return postgres.dsn()


def _postgres_table(dsn: str) -> Iterator[str]:
    table = f"predictions_test_{uuid.uuid4().hex[:12]}"
    try:
        yield table
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))


@pytest.fixture(params=["parquet", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    clock = lambda: NOW  # noqa: E731
    if request.param == "parquet":
        root = tmp_path / "predictions"
        yield Backend(ParquetStore(root, "gateway-zone-a-0", clock), ParquetReader(root, clock))
        return
    dsn: str = request.getfixturevalue("dsn")
    for table in _postgres_table(dsn):
        store = PostgresStore(dsn, table)
        try:
            yield Backend(store, PostgresReader(dsn, table, clock))
        finally:
            store.close()


def _day(n_calls: int = 300) -> list[Row]:
    """A day of traffic: calls every few minutes, one slow per hundred, some errors."""
    rows = []
    for i in range(n_calls):
        at = NOW - i * 280  # spread over ~23 h
        slow = i % 100 == 7
        rows.append(
            row(
                at,
                request_id=f"r{i}",
                total_ms=900.0 + i if slow else 4.0 + (i % 10) * 0.1,
                entity_ids=(f"c-{i % 20}",),
                status="UNAVAILABLE" if i % 50 == 3 else "OK",
            )
        )
    return rows


def test_the_slowest_one_percent_of_today(backend: Backend) -> None:
    backend.store.write(_day())
    found = backend.reader.query(LogQuery(since_s=86400, slowest_share=1.0))
    assert found.matched == 300 and found.selected == 3
    assert [r["request_id"] for r in found.rows] == ["r207", "r107", "r7"]
    assert [r["total_ms"] for r in found.rows] == [1107.0, 1007.0, 907.0]


def test_every_call_of_one_customer_in_the_last_hour(backend: Backend) -> None:
    rows = _day()
    rows.append(row(NOW - 60, request_id="wine", entity_ids=(), entity_rows=({"c": "c-17"},)))
    backend.store.write(rows)
    # Calls 0..12 fall in the last hour (280 s apart); c-17 is call 17 (too old) ...
    found = backend.reader.query(LogQuery(since_s=3600, entities=(("user", "c-17"),)))
    assert found.rows == []
    found = backend.reader.query(LogQuery(since_s=7200, entities=(("user", "c-17"),)))
    assert [r["request_id"] for r in found.rows] == ["r17"]
    assert found.rows[0]["entities"] == {"user": ["c-17"]}
    # ... and the entity's name matters: c=c-17 is another entity than user=c-17.
    found = backend.reader.query(LogQuery(since_s=3600, entities=(("c", "c-17"),)))
    assert [r["request_id"] for r in found.rows] == ["wine"]


def test_errors_of_the_last_five_minutes(backend: Backend) -> None:
    rows = _day()
    rows.append(row(NOW - 10, request_id="bad", status="INVALID_ARGUMENT"))
    rows.append(row(NOW - 20, request_id="deg", degraded=True))
    backend.store.write(rows)
    found = backend.reader.query(LogQuery(since_s=300, errors=True))
    # r3 (840 s ago) is an error too, but older than five minutes.
    assert [(r["request_id"], r["status"]) for r in found.rows] == [("bad", "INVALID_ARGUMENT")]
    assert found.rows[0]["message"] == "invalid_argument: something"
    degraded = backend.reader.query(LogQuery(since_s=300, degraded=True))
    assert [r["request_id"] for r in degraded.rows] == ["deg"]
    assert degraded.rows[0]["degraded_reason"] == "feature service: down"


def test_model_version_request_id_and_limit(backend: Backend) -> None:
    backend.store.write(
        [
            row(NOW - 1, request_id="a", version="v1"),
            row(NOW - 2, request_id="b", version="v2"),
            row(NOW - 3, request_id="c", version="v2", model="other"),
        ]
    )
    pick = backend.reader.query
    assert [r["request_id"] for r in pick(LogQuery(model="fraud", version="v2")).rows] == ["b"]
    assert [r["request_id"] for r in pick(LogQuery(request_id="c")).rows] == ["c"]
    limited = pick(LogQuery(limit=2))
    assert [r["request_id"] for r in limited.rows] == ["a", "b"] and limited.matched == 3
    first = limited.rows[0]
    assert (first["gateway"], first["replica"], first["zone"]) == (
        "gateway-zone-a-0",
        "model-fraud-zone-a-0",
        "zone-a",
    )
    assert first["outputs"] == {"score": [[0.5]]}
    assert first["ts"].timestamp() == pytest.approx(NOW - 1, abs=1e-3)


def test_retention_deletes_what_is_older(backend: Backend) -> None:
    backend.store.write([row(NOW - 9 * 86400, request_id="old")])
    backend.store.write([row(NOW - 60, request_id="new")])
    assert backend.reader.query(LogQuery(since_s=30 * 86400)).matched == 2
    backend.reader.expire(7 * 86400)
    found = backend.reader.query(LogQuery(since_s=30 * 86400))
    assert [r["request_id"] for r in found.rows] == ["new"]
    # The writer's own retention does the same.
    backend.store.write([row(NOW - 8 * 86400, request_id="older")])
    backend.store.expire(int((NOW - 7 * 86400) * 1000))
    assert backend.reader.summary().rows == 1


def test_postgres_creates_its_table_with_the_indexes_queries_use(dsn: str) -> None:
    for table in _postgres_table(dsn):
        store = PostgresStore(dsn, table)
        try:
            store.write([row(NOW)])
            # A second writer meets the existing table.
            other = PostgresStore(dsn, table)
            other.write([row(NOW)])
            other.close()
        finally:
            store.close()
        with psycopg.connect(dsn) as conn:
            indexes = conn.execute(
                "SELECT indexdef FROM pg_indexes WHERE tablename = %s", (table,)
            ).fetchall()
        definitions = " ".join(i[0] for i in indexes)
        assert "(ts)" in definitions and "gin (entity_keys)" in definitions
        assert "(status, ts)" in definitions and "(request_id)" in definitions
        assert PostgresReader(dsn, table).summary().rows == 2


def test_a_dead_postgres_fails_the_write_and_the_next_one_reconnects() -> None:
    store = PostgresStore("host=127.0.0.1 port=1 dbname=test connect_timeout=2", "t")
    with pytest.raises(psycopg.OperationalError):
        store.write([row(NOW)])
    store.close()


# --- Parquet files: merging and retention -----------------------------------------------


def test_flush_files_merge_into_one_and_readers_never_count_twice(tmp_path: Path) -> None:
    clock = [NOW]
    root = tmp_path / "predictions"
    store = ParquetStore(root, "g", lambda: clock[0])
    for i in range(MERGE_RUN + 1):
        store.write([row(NOW - 10 + i * 0.01, request_id=f"r{i}")])
        store.compact()
    files = instance_files(root / "g")
    assert [(f.first, f.last) for f in files] == [(1, MERGE_RUN), (MERGE_RUN + 1, MERGE_RUN + 1)]
    reader = ParquetReader(root, lambda: clock[0])
    assert reader.query(LogQuery()).matched == MERGE_RUN + 1
    # Once the hour is over and settled, its files become one.
    clock[0] = NOW + 3600 + 120
    store.compact()
    assert [(f.first, f.last) for f in instance_files(root / "g")] == [(1, MERGE_RUN + 1)]
    assert reader.query(LogQuery(since_s=7200)).matched == MERGE_RUN + 1


def _merged_after_the_first_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[ParquetReader, list[int]]:
    """A reader of MERGE_RUN + 1 flush files whose writer merges them right after the
    reader's first listing, as a gateway may; and the length of each listing it makes."""
    root = tmp_path / "predictions"
    store = ParquetStore(root, "g", lambda: NOW)
    for i in range(MERGE_RUN + 1):
        store.write([row(NOW - 10 + i * 0.01, request_id=f"r{i}")])
    listings: list[int] = []

    def listed_then_merged(folder: Path, since_ms: int = 0) -> list[object]:
        found = live_files(folder, since_ms)
        if not listings:
            store.compact()
            assert not all(f.path.exists() for f in found)
        listings.append(len(found))
        return found  # type: ignore[return-value]

    monkeypatch.setattr("servemesh.predlog.query.live_files", listed_then_merged)
    return ParquetReader(root, lambda: NOW), listings


def test_a_read_whose_files_a_merge_removed_is_made_again_on_a_new_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader, listings = _merged_after_the_first_listing(tmp_path, monkeypatch)
    assert reader.query(LogQuery()).matched == MERGE_RUN + 1  # every call once
    assert listings == [MERGE_RUN + 1, 2]


def test_a_summary_whose_files_a_merge_removed_is_made_again_on_a_new_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`servemesh log status` under a writer that merges its files meanwhile."""
    reader, listings = _merged_after_the_first_listing(tmp_path, monkeypatch)
    assert reader.summary().rows == MERGE_RUN + 1
    assert listings == [MERGE_RUN + 1, 2]


def test_a_merge_cut_short_leaves_no_duplicates(tmp_path: Path) -> None:
    root = tmp_path / "predictions"
    store = ParquetStore(root, "g", lambda: NOW)
    for i in range(3):
        store.write([row(NOW - 3 + i, request_id=f"r{i}")])
    inputs = instance_files(root / "g")
    kept = {p.path: p.path.read_bytes() for p in inputs[:2]}
    store._merge(inputs[:2])
    # The merged file is in place, but the writer died before deleting its inputs.
    for path, data in kept.items():
        path.write_bytes(data)
    assert len(list((root / "g").glob("*.parquet"))) == 4
    assert ParquetReader(root, lambda: NOW).query(LogQuery()).matched == 3
    # A writer starting again removes the leftovers.
    ParquetStore(root, "g", lambda: NOW)
    assert len(list((root / "g").glob("*.parquet"))) == 2


def test_several_gateways_write_side_by_side_and_old_files_go(tmp_path: Path) -> None:
    root = tmp_path / "predictions"
    a = ParquetStore(root, "gateway-zone-a-0", lambda: NOW)
    b = ParquetStore(root, "gateway-zone-b-0", lambda: NOW)
    a.write([row(NOW - 8 * 86400, request_id="a-old")])
    a.write([row(NOW - 5, request_id="a-new")])
    b.write([row(NOW - 4, request_id="b-new")])
    assert len(live_files(root)) == 3
    assert a.expire(int((NOW - 7 * 86400) * 1000)) == 1
    found = ParquetReader(root, lambda: NOW).query(LogQuery(since_s=30 * 86400))
    assert sorted(r["request_id"] for r in found.rows) == ["a-new", "b-new"]
    # A writer that starts again carries on after its last sequence number.
    again = ParquetStore(root, "gateway-zone-a-0", lambda: NOW)
    assert again.next_seq == 3


def test_the_entities_a_model_s_calls_named_most(backend: Backend) -> None:
    # user-0 in 8 calls, user-1 in 4, user-2 in 2, user-3 in 1; one call names two; one
    # call of another model and one older than the window are not counted.
    rows = [row(NOW - i, request_id=f"a{i}", entity_ids=("user-0",)) for i in range(8)]
    rows += [row(NOW - 10 - i, request_id=f"b{i}", entity_ids=("user-1",)) for i in range(3)]
    rows.append(row(NOW - 20, request_id="c", entity_ids=("user-1", "user-2")))
    rows.append(row(NOW - 21, request_id="d", entity_ids=("user-2",), status="UNAVAILABLE"))
    rows.append(row(NOW - 22, request_id="e", entity_ids=("user-3",)))
    rows.append(row(NOW - 23, request_id="f", entity_ids=("user-3",), model="other"))
    rows.append(row(NOW - 3 * 86400, request_id="g", entity_ids=("user-3",)))
    backend.store.write(rows)
    top = backend.reader.top_entities("fraud", "user", since_s=86400, limit=2)
    assert top.rows == [("user-0", 8), ("user-1", 4)]
    assert (top.calls, top.distinct) == (15, 4)
    assert backend.reader.top_entities("fraud", "user", since_s=86400, limit=9).rows[2:] == [
        ("user-2", 2),
        ("user-3", 1),
    ]
    assert backend.reader.top_entities("fraud", "account", 86400, 5).rows == []
    assert backend.reader.top_entities("nobody", "user", 86400, 5).calls == 0


def test_each_call_says_which_tier_answered_and_can_be_found_by_it(backend: Backend) -> None:
    backend.store.write(
        [
            row(NOW - 30, request_id="online"),
            row(NOW - 20, request_id="cached", tier=gateway_pb2.TIER_CACHE),
            row(NOW - 10, request_id="batch", tier=gateway_pb2.TIER_PRECOMPUTED),
            row(NOW - 5, request_id="failed", status="UNAVAILABLE"),
        ]
    )
    every = backend.reader.query(LogQuery(since_s=300))
    assert {r["request_id"]: r["tier"] for r in every.rows} == {
        "online": "online",
        "cached": "cache",
        "batch": "precomputed",
        "failed": "",  # no tier answered it
    }
    found = backend.reader.query(LogQuery(since_s=300, tier="cache"))
    assert [r["request_id"] for r in found.rows] == ["cached"]


def test_files_written_before_the_tier_column_read_as_no_tier(tmp_path: Path) -> None:
    root = tmp_path / "predictions"
    store = ParquetStore(root, "gateway-zone-a-0", lambda: NOW)
    store.write([row(NOW - 10, request_id="old")])
    (written,) = instance_files(root / "gateway-zone-a-0")
    table = pq.read_table(written.path)
    pq.write_table(table.drop_columns(["tier"]), written.path)  # as an older gateway wrote it
    store.write([row(NOW - 5, request_id="new", tier=gateway_pb2.TIER_CACHE)])
    found = ParquetReader(root, lambda: NOW).query(LogQuery(since_s=300))
    assert {r["request_id"]: r["tier"] for r in found.rows} == {"old": "", "new": "cache"}


def test_a_table_made_before_the_tier_column_gains_it(dsn: str) -> None:
    for table in _postgres_table(dsn):
        columns = COLUMNS[: COLUMNS.index("tier")]
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE TABLE {} ({})").format(
                    sql.Identifier(table),
                    sql.SQL(", ").join(
                        sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(kind))
                        for c, kind in zip(columns, OLD_TYPES, strict=True)
                    ),
                )
            )
        store = PostgresStore(dsn, table)
        try:
            store.write([row(NOW - 5, request_id="new", tier=gateway_pb2.TIER_PRECOMPUTED)])
        finally:
            store.close()
        found = PostgresReader(dsn, table, lambda: NOW).query(LogQuery(since_s=300))
        assert [(r["request_id"], r["tier"]) for r in found.rows] == [("new", "precomputed")]


# The column types of a table as the first release made it (every column before `tier`).
OLD_TYPES = (
    "timestamptz NOT NULL",
    *("text NOT NULL",) * 8,
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
)


def test_calls_are_counted_per_utc_hour_for_a_forecast(backend: Backend) -> None:
    hour = NOW - NOW % 3600  # 08:00 UTC
    backend.store.write(
        [
            row(hour - 3600 + 10, request_id="a"),
            row(hour - 3600 + 20, request_id="b"),
            row(hour + 5, request_id="c"),
            row(hour - 3 * 86400, request_id="old"),
        ]
    )
    found = backend.reader.hourly_calls(86400)
    assert [(at.astimezone(UTC).hour, n) for at, n in found] == [(7, 2), (8, 1)]


def test_each_record_keeps_its_vector_s_hash_and_the_values_a_model_logs(
    backend: Backend,
) -> None:
    sent = vector([1.0, 2.0, 3.0])
    backend.store.write(
        [
            row(NOW - 30, request_id="kept", context=LOGGED, inputs=sent),
            row(NOW - 20, request_id="private", inputs=vector([4.0, 5.0, 6.0])),
            row(NOW - 10, request_id="failed", context=LOGGED, status="UNAVAILABLE"),
        ]
    )
    found = {r["request_id"]: r for r in backend.reader.query(LogQuery(since_s=300)).rows}
    assert found["kept"]["features"] == {"f00": [1], "f01": [2], "f02": [3]}
    assert found["kept"]["feature_hash"] == feature_hash(TYPES, sent)[0]
    assert found["kept"]["feature_count"] == 3
    assert found["private"]["features"] is None and found["private"]["feature_count"] == 3
    assert (found["failed"]["feature_hash"], found["failed"]["feature_count"]) == ("", 0)
    records = backend.reader.feature_records("fraud", None, 300, 10)
    assert (records.calls, records.with_values) == (3, 1)
    assert records.values == [{"f00": [1], "f01": [2], "f02": [3]}]
    assert backend.reader.feature_records("fraud", "v2", 300, 10).calls == 0
    assert backend.reader.feature_records("other", None, 300, 10).calls == 0


def test_files_written_before_the_feature_columns_still_answer(tmp_path: Path) -> None:
    root = tmp_path / "predictions"
    store = ParquetStore(root, "gateway-zone-a-0", lambda: NOW)
    store.write([row(NOW - 10, request_id="old")])
    (written,) = instance_files(root / "gateway-zone-a-0")
    table = pq.read_table(written.path)
    # As a gateway of the release before wrote it: none of the files has the columns.
    pq.write_table(table.drop_columns(["feature_hash", "feature_count", "features"]), written.path)
    reader = ParquetReader(root, lambda: NOW)
    (old,) = reader.query(LogQuery(since_s=300)).rows
    assert (old["request_id"], old["feature_hash"], old["feature_count"]) == ("old", "", 0)
    assert old["features"] is None
    records = reader.feature_records("fraud", None, 300, 10)
    assert (records.calls, records.with_values, records.values) == (1, 0, [])
