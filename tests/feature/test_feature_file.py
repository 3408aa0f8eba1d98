"""Reading feature files without a network: batches, line and row names, times, types."""

from __future__ import annotations

import datetime
import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servemesh.features import FeatureFile, FileError
from servemesh.features._read import FileRows

NOW_MS = 1_800_000_000_000


def read_all(file: FeatureFile, key: str = "id", timestamp: str | None = None) -> list[FileRows]:
    layout = file.layout(key, timestamp, None)
    return list(file.read(layout, allow_nan=False, now_ms=NOW_MS))


def test_a_parquet_file_is_read_in_batches_of_at_most_batch_rows(tmp_path: Path) -> None:
    path = tmp_path / "f.parquet"
    n = 1050
    pq.write_table(
        pa.table({"id": list(range(n)), "x": np.arange(n, dtype=np.float64)}),
        path,
        row_group_size=300,
    )
    file = FeatureFile(path, batch_rows=100)
    batches = read_all(file)
    assert [len(b) for b in batches] == [100] * 10 + [50]
    assert [b.first for b in batches][:3] == [0, 100, 200]
    assert batches[-1].entity_ids[-1] == "1049" and batches[-1].values[-1, 0] == 1049.0
    assert file.total_rows == n


def test_a_gzipped_csv_streams_and_names_lines_past_a_skipped_one(tmp_path: Path) -> None:
    path = tmp_path / "f.csv.gz"
    lines = ["id,x"] + [f"e{i},{i}" for i in range(30)]
    lines.insert(12, "bad,1,2")  # line 13: a cell too many; later lines shift by one
    lines[25] = "e24,oops"  # line 26
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    file = FeatureFile(path, batch_rows=7)
    assert file.format == "csv" and file.row_label == "line"
    batches = read_all(file)
    assert sum(len(b) for b in batches) == 30
    problems = [p for b in batches for p in b.problems]
    assert problems == [
        "line 13: 3 cells where the header has 2",
        "line 26: x: 'oops' is not a number",
    ]


@pytest.mark.parametrize(
    ("cells", "expected_ms"),
    [
        (["2024-05-01T12:00:00Z", "2024-05-01T14:00:00+02:00"], [1714564800000] * 2),
        (["2024-05-01 12:00:00", "2024-05-01T12:00:00"], [1714564800000] * 2),
        (["1714564800", "1714564800.25"], [1714564800000, 1714564800250]),
        (["1714564800", "2024-05-01T12:00:00Z"], [1714564800000] * 2),  # mixed: cell by cell
    ],
)
def test_csv_times_read_as_iso_8601_or_epoch_seconds(
    tmp_path: Path, cells: list[str], expected_ms: list[int]
) -> None:
    path = tmp_path / "t.csv"
    path.write_text("id,x,ts\n" + "".join(f"e{i},1,{c}\n" for i, c in enumerate(cells)))
    [batch] = read_all(FeatureFile(path), timestamp="ts")
    assert batch.problems == []
    assert batch.event_ms is not None and batch.event_ms.tolist() == expected_ms


@pytest.mark.parametrize(
    ("column", "expected_ms"),
    [
        (pa.array([1714564800123456789], pa.timestamp("ns", tz="UTC")), 1714564800123),
        (pa.array([1714564800], pa.timestamp("s")), 1714564800000),
        (pa.array([datetime.date(2024, 5, 1)], pa.date32()), 1714521600000),
        (pa.array([1714564800], pa.int64()), 1714564800000),
        (pa.array([1714564800.5], pa.float64()), 1714564800500),
    ],
)
def test_parquet_time_columns_of_every_kind(
    tmp_path: Path, column: pa.Array, expected_ms: int
) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ["a"], "x": [1.0], "ts": column}), path)
    [batch] = read_all(FeatureFile(path), timestamp="ts")
    assert batch.problems == []
    assert batch.event_ms is not None and batch.event_ms.tolist() == [expected_ms]


def test_bad_times_are_named_and_future_ones_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("id,x,ts\na,1,yesterday\nb,1,\n")
    [batch] = read_all(FeatureFile(path), timestamp="ts")
    assert batch.problems[0] == (
        "line 2: ts: 'yesterday' is not an ISO 8601 time (2024-05-01T12:00:00Z) "
        "or seconds since the Unix epoch"
    )
    assert batch.problems[1] == "line 3: ts: empty event time"
    # Milliseconds where seconds are expected land thousands of years ahead.
    future = tmp_path / "f.csv"
    future.write_text("id,x,ts\nc,1,1714564800000\n")
    [batch] = read_all(FeatureFile(future), timestamp="ts")
    assert batch.problems == [
        "line 2: ts: 1714564800000000 ms since the epoch is more than a day in the future "
        "(numbers are read as seconds since the Unix epoch)"
    ]


def test_column_types_that_cannot_be_features_are_refused_up_front(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [1.5], "flag": [True], "x": [1.0]}), path)
    with pytest.raises(FileError) as err:
        FeatureFile(path).layout("id", None, None)
    assert "id: keys are text or integers, not double" in str(err.value)
    assert "flag: holds bool, not numbers" in str(err.value)


def test_files_that_are_not_what_they_say_are_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "f.parquet"
    path.write_text("id,x\na,1\n")
    with pytest.raises(FileError, match="not a readable parquet file"):
        FeatureFile(path)
    with pytest.raises(FileError, match="cannot tell CSV from Parquet"):
        FeatureFile(path.rename(tmp_path / "f.txt"))
    with pytest.raises(FileError, match="no such file"):
        FeatureFile(tmp_path / "missing.csv")
