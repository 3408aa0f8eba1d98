"""Reading a feature file in record batches: CSV or Parquet, never the whole file at once.

Each batch becomes `FileRows`: entity keys, a float32 matrix in the view's feature order,
event times in milliseconds, and the problems found in it, each naming the row the way the
file does (CSV: `line N`, counting the header as line 1; Parquet: `row N`, from 0) and the
column.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from servemesh.contract.errors import ServemeshError
from servemesh.services.feature.rows import (
    Problem,
    check_event_times,
    check_ids,
    check_values,
)

Format = Literal["csv", "parquet"]
# Rows per record batch read from the file (and at most per message sent).
DEFAULT_BATCH_ROWS = 65_536
# Bytes of CSV text parsed at a time.
CSV_BLOCK_BYTES = 4 * 1024 * 1024
_SUFFIXES: dict[str, Format] = {
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_MS_PER_UNIT = {"s": 1000.0, "ms": 1.0, "us": 1e-3, "ns": 1e-6}
_TIME_HELP = "an ISO 8601 time (2024-05-01T12:00:00Z) or seconds since the Unix epoch"


class FileError(ServemeshError):
    """The file cannot be loaded at all (unreadable, a column missing or of a wrong type)."""


def detect_format(path: Path, given: str | None = None) -> Format:
    """The file's format: `given`, else by suffix (.csv, .csv.gz, .parquet, .pq)."""
    if given is not None:
        if given not in ("csv", "parquet"):
            raise FileError(f"--format: {given!r} is not csv or parquet")
        return "csv" if given == "csv" else "parquet"
    suffixes = [s.lower() for s in path.suffixes]
    for suffix in reversed(suffixes):
        if suffix in _SUFFIXES:
            return _SUFFIXES[suffix]
    raise FileError(f"{path.name}: cannot tell CSV from Parquet by its name; give --format")


@dataclass(frozen=True)
class Layout:
    """Which columns of the file are what."""

    key: str
    timestamp: str | None
    # The view's features, in the order they are stored.
    features: list[str]


@dataclass
class FileRows:
    """One batch of the file, converted; `problems` name the file's rows in its own words."""

    first: int  # how the first row is named: its line (CSV) or row index (Parquet)
    entity_ids: list[str]
    values: np.ndarray  # float32 (n, features)
    event_ms: np.ndarray | None  # int64 (n,), None: the load's start time
    problems: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entity_ids)


class FeatureFile:
    """A CSV or Parquet file of feature rows, read in record batches."""

    def __init__(
        self, path: str | Path, fmt: str | None = None, batch_rows: int = DEFAULT_BATCH_ROWS
    ) -> None:
        if batch_rows < 1:
            raise FileError("--batch-rows: must be at least 1")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileError(f"{self.path}: no such file")
        self.format = detect_format(self.path, fmt)
        self.batch_rows = batch_rows
        # CSV lines the parser skipped (a wrong number of cells), with what was wrong.
        self._skipped: list[int] = []
        self._untold: dict[int, str] = {}
        try:
            if self.format == "parquet":
                self._parquet: pq.ParquetFile | None = pq.ParquetFile(self.path)
                self.schema: pa.Schema = self._parquet.schema_arrow
            else:
                self._parquet = None
                peek = self._csv_reader(column_types=None)
                self.schema = peek.schema
                peek.close()
                self._skipped.clear()  # batches() reads the file again from its start
                self._untold.clear()
        except (pa.ArrowException, OSError) as exc:
            raise FileError(f"{self.path.name}: not a readable {self.format} file: {exc}") from None

    @property
    def row_label(self) -> Literal["line", "row"]:
        return "line" if self.format == "csv" else "row"

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    @property
    def total_rows(self) -> int | None:
        """Rows in the file when its metadata says (Parquet); None for CSV."""
        return self._parquet.metadata.num_rows if self._parquet is not None else None

    def layout(self, key: str, timestamp: str | None, view_features: list[str] | None) -> Layout:
        """Match the file's columns to the view; FileError listing every mismatch."""
        columns = self.columns
        repeated = sorted({c for c in columns if columns.count(c) > 1})
        problems = [f"columns named more than once: {repeated}"] if repeated else []
        for flag, name in (("--key", key), ("--timestamp", timestamp)):
            if name is not None and name not in columns:
                problems.append(f"{flag} {name}: no such column; the file has {_few(columns)}")
        if key == timestamp:
            problems.append("--timestamp: the key column cannot be the event time too")
        rest = [c for c in columns if c not in (key, timestamp)]
        if view_features is None:
            features = rest
            if not features:
                problems.append("the file has no feature columns besides the key")
        else:
            features = list(view_features)
            lacking = [f for f in view_features if f not in rest]
            unknown = [c for c in rest if c not in set(view_features)]
            if lacking:
                problems.append(f"feature columns missing: {_few(lacking)}")
            if unknown:
                problems.append(
                    f"columns that are not features of the view: {_few(unknown)} "
                    "(the view's features are in the mesh spec)"
                )
        if problems:
            raise FileError(f"{self.path.name}: " + "; ".join(problems))
        layout = Layout(key=key, timestamp=timestamp, features=features)
        if self.format == "parquet":
            self._check_parquet_types(layout)
        return layout

    def _check_parquet_types(self, layout: Layout) -> None:
        problems = []
        key_type = self.schema.field(layout.key).type
        if not (_is_text(key_type) or pa.types.is_integer(key_type)):
            problems.append(f"{layout.key}: keys are text or integers, not {key_type}")
        for name in layout.features:
            kind = self.schema.field(name).type
            if not (_is_number(kind) or _is_text(kind) or pa.types.is_null(kind)):
                problems.append(f"{name}: holds {kind}, not numbers")
        if layout.timestamp is not None:
            kind = self.schema.field(layout.timestamp).type
            if not (
                pa.types.is_timestamp(kind)
                or pa.types.is_date(kind)
                or _is_number(kind)
                or _is_text(kind)
            ):
                problems.append(f"{layout.timestamp}: holds {kind}, not times")
        if problems:
            raise FileError(f"{self.path.name}: " + "; ".join(problems))

    # --- reading -----------------------------------------------------------------------

    def batches(self, layout: Layout) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(index of the batch's first data row, batch), for every batch of the file."""
        wanted = [layout.key, *layout.features]
        if layout.timestamp is not None:
            wanted.append(layout.timestamp)
        try:
            if self._parquet is not None:
                source: Iterator[pa.RecordBatch] = self._parquet.iter_batches(
                    batch_size=self.batch_rows, columns=wanted
                )
            else:
                # Every column as text: a cell that is not a number is then reported with
                # its line, where the CSV converter would name neither line nor cell.
                reader = self._csv_reader(column_types={c: pa.string() for c in self.columns})
                source = _sliced(reader, self.batch_rows)
            start = 0
            for batch in source:
                yield start, batch
                start += batch.num_rows
        except pa.ArrowException as exc:
            raise FileError(f"{self.path.name}: cannot read on: {exc}") from None

    def _csv_reader(self, column_types: dict[str, pa.DataType] | None) -> Any:
        def skip(row: Any) -> str:
            self._skipped.append(int(row.number))
            self._untold[int(row.number)] = (
                f"{row.actual_columns} cells where the header has {row.expected_columns}"
            )
            return "skip"

        return pa_csv.open_csv(
            self.path,
            read_options=pa_csv.ReadOptions(use_threads=False, block_size=CSV_BLOCK_BYTES),
            parse_options=pa_csv.ParseOptions(ignore_empty_lines=False, invalid_row_handler=skip),
            convert_options=pa_csv.ConvertOptions(
                column_types=column_types or {},
                strings_can_be_null=True,
                null_values=[""],
                quoted_strings_can_be_null=False,
            ),
        )

    def name_of(self, index: int) -> int:
        """How the report names data row `index` (0-based): its CSV line, or the index."""
        if self.format == "parquet":
            return index
        line = index + 2  # line 1 is the header
        for skipped in self._skipped:  # sorted: the parser reads the file in order
            if skipped <= line:
                line += 1
            else:
                break
        return line

    def _skipped_before(self, index: int | None) -> list[tuple[int, str]]:
        """(line, problem) of CSV lines skipped before data row `index` (None: all),
        each told once."""
        limit = self.name_of(index) if index is not None else None
        told = sorted(n for n in self._untold if limit is None or n < limit)
        return [(n, f"line {n}: {self._untold.pop(n)}") for n in told]

    def read(
        self, layout: Layout, allow_nan: bool, now_ms: int | None = None
    ) -> Iterator[FileRows]:
        """Every batch converted and checked; problems in each name their line/row."""
        for start, batch in self.batches(layout):
            rows = convert(batch, layout, allow_nan, now_ms or _now_ms())
            found = self._skipped_before(start + batch.num_rows)
            found += [self._where(start, p) for p in rows.problems_at]
            yield FileRows(
                first=self.name_of(start),
                entity_ids=rows.entity_ids,
                values=rows.values,
                event_ms=rows.event_ms,
                problems=[text for _, text in sorted(found)],
            )
        trailing = self._skipped_before(None)
        if trailing:
            yield FileRows(
                first=0,
                entity_ids=[],
                values=np.zeros((0, len(layout.features)), dtype=np.float32),
                event_ms=None,
                problems=[text for _, text in trailing],
            )

    def _where(self, start: int, problem: Problem) -> tuple[int, str]:
        number = self.name_of(start + problem.row)
        column = f"{problem.column}: " if problem.column else ""
        return number, f"{self.row_label} {number}: {column}{problem.message}"


@dataclass
class Converted:
    entity_ids: list[str]
    values: np.ndarray
    event_ms: np.ndarray | None
    problems_at: list[Problem]


def convert(batch: pa.RecordBatch, layout: Layout, allow_nan: bool, now_ms: int) -> Converted:
    """Keys, float32 values and event times of one batch, with every problem found."""
    problems: list[Problem] = []
    keys = batch.column(layout.key)
    if pa.types.is_integer(keys.type):
        keys = pc.cast(keys, pa.string())
    entity_ids = [k if k is not None else "" for k in keys.to_pylist()]
    problems += check_ids(entity_ids, layout.key)
    # Feature by feature (each a contiguous row here), then turned to rows at the end.
    by_feature = np.empty((len(layout.features), batch.num_rows), dtype=np.float64)
    for j, name in enumerate(layout.features):
        by_feature[j], bad = _numbers(batch.column(name), name)
        # Cells that are not numbers at all are reported once, not again as NaN.
        by_feature[j, [p.row for p in bad]] = 0.0
        problems += bad
    matrix = by_feature.T
    problems += check_values(matrix, layout.features, allow_nan)
    event_ms = None
    if layout.timestamp is not None:
        event_ms, bad = _times(batch.column(layout.timestamp), layout.timestamp)
        problems += bad or check_event_times(event_ms, now_ms, layout.timestamp)
    # Checked in float64: a value too large for float32 is a problem, not an infinity.
    values = (
        np.ascontiguousarray(matrix, dtype=np.float32)
        if not problems
        else np.zeros((0, len(layout.features)), dtype=np.float32)
    )
    return Converted(entity_ids, values, event_ms, problems)


def _numbers(column: pa.Array, name: str, limit: int = 20) -> tuple[np.ndarray, list[Problem]]:
    """A column as float64 (empty cells as NaN), and the cells that are not numbers."""
    try:
        return _as_float(column), []
    except pa.ArrowInvalid:
        pass
    found: list[Problem] = []
    # Empty cells are NaN; cells past the last problem reported are left unread (0).
    out = np.zeros(len(column))
    out[_null_rows(column)] = np.nan
    for i, cell in enumerate(column.to_pylist()):
        if cell is None:
            continue
        try:
            out[i] = _as_float(pa.array([cell]))[0]
        except pa.ArrowInvalid:
            found.append(Problem(i, name, f"{_cut(cell)!r} is not a number"))
            if len(found) >= limit:
                break
    return out, found


def _as_float(column: pa.Array) -> np.ndarray:
    if pa.types.is_null(column.type):
        return np.full(len(column), np.nan)
    return np.asarray(pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False))


def _times(column: pa.Array, name: str, limit: int = 20) -> tuple[np.ndarray, list[Problem]]:
    """Event times in ms since the epoch; empty cells and unreadable times as problems."""
    found = [Problem(int(i), name, "empty event time") for i in _null_rows(column)[:limit]]
    kind = column.type
    if pa.types.is_timestamp(kind):
        raw = column.cast(pa.int64()).to_numpy(zero_copy_only=False)
        return _scaled(raw, _MS_PER_UNIT[kind.unit]), found
    if pa.types.is_date32(kind):
        return _scaled(column.cast(pa.int32()).to_numpy(zero_copy_only=False), 86_400_000), found
    if pa.types.is_date64(kind):
        return _scaled(column.cast(pa.int64()).to_numpy(zero_copy_only=False), 1.0), found
    if _is_number(kind):
        return _scaled(_as_float(column), 1000.0), found
    # Text: every cell one way (seconds, a time with its offset, or a UTC wall time).
    for parse in (_text_seconds, _text_with_offset, _text_utc):
        try:
            return parse(column), found
        except pa.ArrowInvalid:
            continue
    out = np.zeros(len(column), dtype=np.int64)
    for i, cell in enumerate(column.to_pylist()):
        if cell is None:
            continue
        for parse in (_text_seconds, _text_with_offset, _text_utc):
            try:
                out[i] = parse(pa.array([cell]))[0]
                break
            except pa.ArrowInvalid:
                continue
        else:
            found.append(Problem(i, name, f"{_cut(cell)!r} is not {_TIME_HELP}"))
            if len(found) >= limit:
                break
    return out, found


def _text_seconds(column: pa.Array) -> np.ndarray:
    return _scaled(_as_float(column), 1000.0)


def _text_with_offset(column: pa.Array) -> np.ndarray:
    parsed = pc.cast(column, pa.timestamp("ns", tz="UTC")).cast(pa.int64())
    return _scaled(parsed.to_numpy(zero_copy_only=False), 1e-6)


def _text_utc(column: pa.Array) -> np.ndarray:
    parsed = pc.cast(column, pa.timestamp("ns")).cast(pa.int64())
    return _scaled(parsed.to_numpy(zero_copy_only=False), 1e-6)


def _scaled(raw: np.ndarray, ms_per_unit: float) -> np.ndarray:
    """Milliseconds as int64; NaN (an empty cell) becomes 0 and is reported elsewhere."""
    as_float = np.nan_to_num(np.asarray(raw, dtype=np.float64) * ms_per_unit)
    return np.rint(as_float).astype(np.int64)


def _null_rows(column: pa.Array) -> np.ndarray:
    if column.null_count == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))


def _sliced(reader: Any, rows: int) -> Iterator[pa.RecordBatch]:
    for batch in reader:
        for offset in range(0, batch.num_rows, rows):
            yield batch.slice(offset, rows)


def _is_text(kind: pa.DataType) -> bool:
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind))


def _is_number(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)
    )


def _few(names: Sequence[str], shown: int = 8) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _cut(cell: object) -> str:
    text = str(cell)
    return text if len(text) <= 40 else text[:37] + "..."


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
