"""`servemesh features load` end to end: the CLI (its own process) finds the mesh in its
state dir, streams the file to a real feature service, and reads through that service
see the new version; a bad file changes nothing in Redis."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servemesh.spec import FeatureViewSpec
from servemesh_api.feature.v1 import feature_pb2
from tests.feature.conftest import RunningFeatures, StartFeatures

CUSTOMER = {"customer": FeatureViewSpec(features=["amount", "visits"])}
ANY_COLUMNS = {"events": FeatureViewSpec(features=None)}


def write_parquet(
    path: Path, columns: Mapping[str, Sequence[object]], row_group_size: int = 1000
) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


async def read(
    running: RunningFeatures, view: str, ids: list[str], names: list[str]
) -> feature_pb2.GetFeaturesResponse:
    return await running.stub.GetFeatures(
        feature_pb2.GetFeaturesRequest(view=view, entity_ids=ids, feature_names=names)
    )


async def test_a_csv_file_loads_through_the_cli_and_reads_see_its_values(
    start_features: StartFeatures, tmp_path: Path
) -> None:
    running = await start_features(CUSTOMER)
    csv = tmp_path / "customers.csv"
    # Columns in another order than the view's; times as ISO 8601 and as epoch seconds.
    csv.write_text(
        "customer_id,visits,amount,event_ts\n"
        "c-1,3,1.5,2024-05-01T12:00:00Z\n"
        "c-2,4,-2.25,1714564800.5\n"
    )
    code, out, err = await running.cli(
        "features", "load", str(csv), "--view", "customer", "--key", "customer_id",
        "--timestamp", "event_ts",
    )  # fmt: skip
    assert code == 0, err
    assert "2 rows" in out and "version 1" in out and "rows/s" in out
    reply = await read(running, "customer", ["c-2", "c-1"], ["visits", "amount"])
    assert [list(v.values) for v in reply.vectors] == [[4.0, -2.25], [3.0, 1.5]]
    assert [v.event_time_unix_ms for v in reply.vectors] == [1714564800500, 1714564800000]


async def test_without_a_timestamp_column_rows_are_as_old_as_the_load(
    start_features: StartFeatures, tmp_path: Path
) -> None:
    running = await start_features(CUSTOMER)
    csv = tmp_path / "customers.csv"
    csv.write_text("customer_id,amount,visits\nc-1,1,2\n")
    before = time.time_ns() // 1_000_000
    code, _, err = await running.cli(
        "features", "load", str(csv), "--view", "customer", "--key", "customer_id"
    )
    after = time.time_ns() // 1_000_000
    assert code == 0, err
    [vector] = (await read(running, "customer", ["c-1"], ["amount"])).vectors
    assert before <= vector.event_time_unix_ms <= after


async def test_a_parquet_file_replaces_the_view_and_the_old_version_is_deleted(
    start_features: StartFeatures, tmp_path: Path
) -> None:
    running = await start_features(ANY_COLUMNS)
    first = write_parquet(
        tmp_path / "v1.parquet", {"id": [1, 2, 3], "x": [1.0, 2.0, 3.0], "y": [1, 1, 1]}
    )
    second = write_parquet(
        tmp_path / "v2.parquet",
        {"id": ["2", "4"], "y": [np.float32(5.5), np.float32(6.5)], "z": [0.5, 0.25]},
    )
    load = ("features", "load", "--view", "events", "--key", "id")
    code, out, err = await running.cli(*load, str(first))
    assert code == 0 and "version 1" in out, err
    reply = await read(running, "events", ["3", "1"], ["y", "x"])
    assert [list(v.values) for v in reply.vectors] == [[1.0, 3.0], [1.0, 1.0]]

    code, out, err = await running.cli(*load, str(second))
    assert code == 0, err
    assert "version 2" in out and "version 1 replaced (3 keys deleted)" in out
    # The view takes the new file's columns; entities only in the old file are gone.
    reply = await read(running, "events", ["4", "2"], ["z", "y"])
    assert [list(v.values) for v in reply.vectors] == [[0.25, 6.5], [0.5, 5.5]]
    with pytest.raises(grpc.aio.AioRpcError) as err_:
        await read(running, "events", ["1"], ["y"])
    assert err_.value.code() == grpc.StatusCode.NOT_FOUND
    p = running.prefix
    assert {k for k in await running.keys() if "@" in k} == {
        f"{p}:events@2",
        f"{p}:events@2:2",
        f"{p}:events@2:4",
    }


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
async def test_a_file_larger_than_one_batch_streams_in_many_messages(
    start_features: StartFeatures, tmp_path: Path, fmt: str
) -> None:
    # 16 KiB messages: a batch of 100 rows of 8 features goes out as several chunks.
    running = await start_features(ANY_COLUMNS, max_message_bytes=16 * 1024)
    n = 2500
    rng = np.random.default_rng(3)
    values = rng.normal(size=(n, 8)).astype(np.float32)
    columns: dict[str, list[object]] = {"id": [f"e-{i}" for i in range(n)]}
    columns.update({f"f{j}": values[:, j].tolist() for j in range(8)})
    if fmt == "parquet":
        path = write_parquet(tmp_path / "big.parquet", columns, row_group_size=700)
    else:
        path = tmp_path / "big.csv"
        table = pa.table(columns)
        path.write_text(
            "id," + ",".join(f"f{j}" for j in range(8)) + "\n"
            + "".join(
                f"e-{i}," + ",".join(repr(float(v)) for v in values[i]) + "\n" for i in range(n)
            )
        )  # fmt: skip
        assert table.num_rows == n
    code, out, err = await running.cli(
        "features", "load", str(path), "--view", "events", "--key", "id", "--batch-rows", "100"
    )
    assert code == 0, err
    assert f"{n:,} rows" in out
    probe = [0, 99, 100, 1234, n - 1]
    reply = await read(running, "events", [f"e-{i}" for i in probe], [f"f{j}" for j in range(8)])
    got = np.array([list(v.values) for v in reply.vectors], dtype=np.float32)
    assert np.array_equal(got, values[probe])
    assert len([k for k in await running.keys() if "@1:" in k]) == n


async def _load_first_version(running: RunningFeatures, tmp_path: Path) -> set[str]:
    good = tmp_path / "good.csv"
    good.write_text("customer_id,amount,visits\nc-1,1,1\nc-2,2,2\n")
    code, _, err = await running.cli(
        "features", "load", str(good), "--view", "customer", "--key", "customer_id"
    )
    assert code == 0, err
    return {k for k in await running.keys() if not k.endswith(":seq")}


async def _still_the_first_version(running: RunningFeatures, before: set[str]) -> None:
    assert {k for k in await running.keys() if not k.endswith(":seq")} == before
    reply = await read(running, "customer", ["c-1", "c-2"], ["amount", "visits"])
    assert [list(v.values) for v in reply.vectors] == [[1.0, 1.0], [2.0, 2.0]]


async def test_a_bad_row_at_the_end_leaves_the_previous_version_and_nothing_new(
    start_features: StartFeatures, tmp_path: Path
) -> None:
    running = await start_features(CUSTOMER)
    before = await _load_first_version(running, tmp_path)
    bad = tmp_path / "bad.csv"
    rows = "".join(f"n-{i},{i},{i}\n" for i in range(200))
    bad.write_text("customer_id,amount,visits\n" + rows + "n-200,12x,1\n")
    # 10 rows a batch: 200 rows are staged in Redis before the bad line is read.
    code, out, err = await running.cli(
        "features", "load", str(bad), "--view", "customer", "--key", "customer_id",
        "--batch-rows", "10",
    )  # fmt: skip
    assert code == 1
    assert "line 202: amount: '12x' is not a number" in err
    assert "nothing was loaded" in err and out == ""
    await _still_the_first_version(running, before)


async def test_a_duplicate_key_found_by_the_service_mid_stream_loads_nothing(
    start_features: StartFeatures, tmp_path: Path
) -> None:
    running = await start_features(CUSTOMER)
    before = await _load_first_version(running, tmp_path)
    ids = [f"n-{i}" for i in range(300)] + ["n-7"]
    path = write_parquet(
        tmp_path / "dup.parquet",
        {"customer_id": ids, "amount": [1.0] * 301, "visits": [2.0] * 301},
    )
    code, _, err = await running.cli(
        "features", "load", str(path), "--view", "customer", "--key", "customer_id",
        "--batch-rows", "25",
    )  # fmt: skip
    assert code == 1
    assert "row 300: key: 'n-7' appears more than once" in err
    await _still_the_first_version(running, before)


async def test_every_problem_is_reported_with_its_line_and_column(
    start_features: StartFeatures, tmp_path: Path
) -> None:
    running = await start_features(CUSTOMER)
    csv = tmp_path / "messy.csv"
    csv.write_text(
        "customer_id,amount,visits\n"
        "c-1,1,1\n"  # line 2: fine
        ",1,1\n"  # line 3: no key
        "c-3,abc,1\n"  # line 4: not a number
        "c-4,,1\n"  # line 5: empty cell, and the view forbids NaN
        "c-5,1,inf\n"  # line 6: infinite
        "c-6,1\n"  # line 7: a cell short
        "c-7,1e39,1\n"  # line 8: too large for float32
        "c-8,NaN,1\n"  # line 9: NaN
    )
    code, _, err = await running.cli(
        "features", "load", str(csv), "--view", "customer", "--key", "customer_id"
    )
    assert code == 1
    for expected in [
        "line 3: customer_id: empty key",
        "line 4: amount: 'abc' is not a number",
        "line 5: amount: NaN",
        "line 6: visits: inf is not a finite number",
        "line 7: 2 cells where the header has 3",
        "line 8: amount: 1e+39 does not fit a float32",
        "line 9: amount: NaN",
    ]:
        assert expected in err, f"{expected!r} missing from:\n{err}"
    assert "line 2" not in err
    assert await running.keys() == {f"{running.prefix}:customer:seq"}


async def test_parquet_problems_name_the_row_index_and_column(
    start_features: StartFeatures, tmp_path: Path
) -> None:
    running = await start_features(CUSTOMER)
    path = write_parquet(
        tmp_path / "nan.parquet",
        {"customer_id": ["a", "b", None], "amount": [1.0, math.nan, 2.0], "visits": [1, 2, 3]},
    )
    code, _, err = await running.cli(
        "features", "load", str(path), "--view", "customer", "--key", "customer_id"
    )
    assert code == 1
    assert "row 1: amount: NaN" in err and "row 2: customer_id: empty key" in err


async def test_nan_loads_where_the_view_allows_it(
    start_features: StartFeatures, tmp_path: Path
) -> None:
    running = await start_features({"sparse": FeatureViewSpec(features=["a"], allow_nan=True)})
    csv = tmp_path / "sparse.csv"
    csv.write_text("id,a\nx,\ny,NaN\nz,2\n")
    code, _, err = await running.cli(
        "features", "load", str(csv), "--view", "sparse", "--key", "id"
    )
    assert code == 0, err
    reply = await read(running, "sparse", ["x", "y", "z"], ["a"])
    values = [v.values[0] for v in reply.vectors]
    assert math.isnan(values[0]) and math.isnan(values[1]) and values[2] == 2.0


@pytest.mark.parametrize(
    ("header", "args", "expected"),
    [
        ("customer_id,amount\n", (), "feature columns missing: visits"),
        ("customer_id,amount,visits,age\n", (), "not features of the view: age"),
        ("id,amount,visits\n", (), "--key customer_id: no such column"),
        ("customer_id,amount,visits\n", ("--timestamp", "ts"), "--timestamp ts: no such column"),
        ("customer_id,amount,visits\n", ("--view", "nope"), "--view nope: not a feature view"),
    ],
)
async def test_a_file_that_does_not_fit_the_view_is_refused_before_anything_is_sent(
    start_features: StartFeatures,
    tmp_path: Path,
    header: str,
    args: tuple[str, ...],
    expected: str,
) -> None:
    running = await start_features(CUSTOMER)
    csv = tmp_path / "odd.csv"
    csv.write_text(header + "c-1,1,1\n")
    view = () if "--view" in args else ("--view", "customer")
    code, _, err = await running.cli(
        "features", "load", str(csv), *view, "--key", "customer_id", *args
    )
    assert code == 1, err
    assert expected in err
    assert await running.keys() == set()


async def test_a_file_without_rows_does_not_empty_the_view(
    start_features: StartFeatures, tmp_path: Path
) -> None:
    running = await start_features(CUSTOMER)
    before = await _load_first_version(running, tmp_path)
    empty = tmp_path / "empty.csv"
    empty.write_text("customer_id,amount,visits\n")
    code, _, err = await running.cli(
        "features", "load", str(empty), "--view", "customer", "--key", "customer_id"
    )
    assert code == 1 and "no rows arrived" in err
    await _still_the_first_version(running, before)


async def test_a_caller_that_hangs_up_mid_load_leaves_nothing_behind(
    start_features: StartFeatures,
) -> None:
    """Redis keyspace events say when the chunk is staged and when the clean-up ended."""
    running = await start_features(CUSTOMER)
    p = running.prefix
    # The session's Redis publishes keyspace events (tests/conftest.py; CONFIG is disabled).
    events = running.redis.pubsub()
    await events.psubscribe(f"__keyspace@0__:{p}:customer*")
    hang = asyncio.Event()

    async def messages() -> AsyncIterator[feature_pb2.LoadFeaturesRequest]:
        yield feature_pb2.LoadFeaturesRequest(
            header=feature_pb2.LoadHeader(view="customer", feature_names=["amount", "visits"])
        )
        yield feature_pb2.LoadFeaturesRequest(
            chunk=feature_pb2.LoadChunk(
                entity_ids=["c-1"], values=np.ones(2, dtype="<f4").tobytes()
            )
        )
        await hang.wait()  # never set: the caller hangs up instead of committing

    async def event(key: str, kind: str) -> None:
        async for message in events.listen():
            if message["type"] != "pmessage":
                continue
            if message["channel"].decode().endswith(key) and message["data"] == kind.encode():
                return

    call = running.stub.LoadFeatures(messages())
    await asyncio.wait_for(event(f"{p}:customer@1:c-1", "set"), 30)  # staged
    call.cancel()
    # The lease goes last, after the rows.
    try:
        await asyncio.wait_for(event(f"{p}:customer:load", "del"), 30)
    finally:
        await events.aclose()
    assert await running.keys() == {f"{p}:customer:seq"}
