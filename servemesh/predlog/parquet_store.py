"""The embedded store: Parquet files per gateway instance under <state_dir>/predictions/.

Several gateway processes write at once, and a DuckDB database file takes one writer
process only; so each gateway writes files of its own into its own folder, and readers
query them all with DuckDB's `read_parquet`. A file is never changed once renamed into
place: it is written beside its final name and renamed (readers never see half a file).

File names carry what readers and retention need without opening a file:
`<first>-<last>_<min_ms>_<max_ms>.parquet`, where first..last is the range of flush
sequence numbers the file holds (one number for a flush, a run for a merged file) and
min/max are its oldest and newest record times. Each flush writes one small file; the
writer merges runs of small files (`compact`) so a day of traffic stays a few hundred files:
64 flushes in a row become one file, and an hour that is over becomes one file. A merge
writes the merged file before it deletes its inputs, so for a moment both exist: readers
take a file whose range lies inside another's as merged away (`live_files`).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from servemesh.predlog.record import COLUMNS, Row

SCHEMA = pa.schema(
    [
        ("ts", pa.timestamp("us", tz="UTC")),
        ("request_id", pa.string()),
        ("trace_id", pa.string()),
        ("gateway", pa.string()),
        ("gateway_zone", pa.string()),
        ("model", pa.string()),
        ("version", pa.string()),
        ("replica", pa.string()),
        ("zone", pa.string()),
        ("entities", pa.string()),
        ("entity_keys", pa.list_(pa.string())),
        ("outputs", pa.string()),
        ("feature_ms", pa.float64()),
        ("inference_ms", pa.float64()),
        ("total_ms", pa.float64()),
        ("status", pa.string()),
        ("message", pa.string()),
        ("degraded", pa.bool_()),
        ("degraded_reason", pa.string()),
        # Files written before a column existed read it as null (query.py).
        ("tier", pa.string()),
        ("feature_hash", pa.string()),
        ("feature_count", pa.int64()),
        ("features", pa.string()),  # null: the model does not log its feature values
    ]
)
assert tuple(SCHEMA.names) == COLUMNS

_NAME = re.compile(r"^(\d{12})-(\d{12})_(\d+)_(\d+)\.parquet$")
HOUR_MS = 3_600_000
# A run of this many flush files in a row is merged into one file.
MERGE_RUN = 64
# An hour's files are merged into one once the hour has been over for this long (a call
# that began in it may still be in a flush shortly after).
HOUR_SETTLE_MS = 60_000
# A merge reads its inputs into memory: it takes at most this many bytes of files.
MERGE_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class PartFile:
    path: Path
    first: int
    last: int
    min_ms: int
    max_ms: int

    @property
    def merged(self) -> bool:
        return self.first != self.last

    @property
    def hour(self) -> int:
        return self.min_ms // HOUR_MS


def part_file(path: Path) -> PartFile | None:
    """The file's flush numbers and time range, as its name states them (None: not a
    file of the log's)."""
    match = _NAME.match(path.name)
    if match is None:
        return None
    first, last, lo, hi = (int(g) for g in match.groups())
    return PartFile(path, first, last, lo, hi)


def instance_files(folder: Path) -> list[PartFile]:
    """One instance's files in sequence order, without those merged into another."""
    if not folder.is_dir():
        return []
    found = sorted(
        (f for f in (part_file(p) for p in folder.iterdir()) if f is not None),
        key=lambda f: (f.first, -f.last),
    )
    kept: list[PartFile] = []
    for part in found:
        # Sorted by first, widest first: a file inside the last kept range was merged into it.
        if kept and part.last <= kept[-1].last:
            continue
        kept.append(part)
    return kept


def live_files(root: Path, since_ms: int | None = None) -> list[PartFile]:
    """Every instance's files under `root` (`<state_dir>/predictions`), without merged-away
    ones and (given `since_ms`) without files whose newest record is older."""
    if not root.is_dir():
        return []
    files: list[PartFile] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files += instance_files(folder)
    if since_ms is not None:
        files = [f for f in files if f.max_ms >= since_ms]
    return files


def expire_files(root: Path, before_ms: int) -> int:
    """Delete every instance's files whose newest record is older than `before_ms`."""
    deleted = 0
    for part in live_files(root):
        if part.max_ms < before_ms:
            part.path.unlink(missing_ok=True)
            deleted += 1
    return deleted


class ParquetStore:
    """The writer of one gateway instance: a file per flush, merged as it goes."""

    kind = "parquet"

    def __init__(self, root: Path, instance: str, clock: Callable[[], float] = time.time):
        self.root = root
        self.folder = root / instance
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.clock = clock
        # Crash leftovers: merged inputs whose merged file made it, and unfinished writes.
        kept = instance_files(self.folder)
        for path in self.folder.iterdir():
            part = part_file(path)
            if (part is not None and part not in kept) or path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
        self.next_seq = max((f.last for f in kept), default=0) + 1

    def describe(self) -> str:
        return f"parquet files under {self.root}"

    def write(self, rows: Sequence[Row]) -> None:
        if not rows:
            return
        table = pa.Table.from_pydict(
            {name: list(col) for name, col in zip(COLUMNS, zip(*rows, strict=True), strict=True)},
            schema=SCHEMA,
        )
        seq = self.next_seq
        times = [r[0].timestamp() for r in rows]
        self._put(table, seq, seq, int(min(times) * 1000), int(max(times) * 1000))
        self.next_seq = seq + 1

    def compact(self) -> None:
        """Merge long runs of flush files, and each hour that is over into one file."""
        now_ms = int(self.clock() * 1000)
        files = instance_files(self.folder)
        run: list[PartFile] = []
        for part in [*files, None]:
            if part is not None and not part.merged:
                run.append(part)
                if len(run) >= MERGE_RUN:
                    self._merge(run)
                    run = []
                continue
            run = []
        # Runs of files (merged or not) of the same hour, once that hour is settled. A file
        # past half the size bound stays as it is: merging never rewrites big files again.
        files = instance_files(self.folder)
        run = []
        size = 0
        for part in [*files, None]:
            part_size = part.path.stat().st_size if part is not None else 0
            if run and (
                part is None
                or part.hour != run[0].hour
                or part_size >= MERGE_MAX_BYTES // 2
                or size + part_size > MERGE_MAX_BYTES
            ):
                settled = (run[0].hour + 1) * HOUR_MS + HOUR_SETTLE_MS <= now_ms
                if settled and len(run) > 1:
                    self._merge(run)
                run, size = [], 0
            if part is not None and part_size < MERGE_MAX_BYTES // 2:
                run.append(part)
                size += part_size

    def expire(self, before_ms: int) -> int:
        deleted = 0
        for part in instance_files(self.folder):
            if part.max_ms < before_ms:
                part.path.unlink(missing_ok=True)
                deleted += 1
        return deleted

    def close(self) -> None:
        pass

    def _merge(self, run: list[PartFile]) -> None:
        tables = [pq.read_table(p.path, schema=SCHEMA) for p in run]
        merged = pa.concat_tables(tables)
        self._put(
            merged,
            run[0].first,
            run[-1].last,
            min(p.min_ms for p in run),
            max(p.max_ms for p in run),
        )
        for part in run:
            part.path.unlink(missing_ok=True)

    def _put(self, table: pa.Table, first: int, last: int, lo: int, hi: int) -> None:
        name = f"{first:012d}-{last:012d}_{lo}_{hi}.parquet"
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".", suffix=".tmp")
        os.close(fd)
        try:
            pq.write_table(table, tmp, compression="zstd")
            os.replace(tmp, self.folder / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
