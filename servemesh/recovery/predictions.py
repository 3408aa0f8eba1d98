"""The prediction log's part of a backup: its Parquet files, each with its sha256.

A file is never changed once in place (servemesh/predlog/parquet_store.py), so copying the
live files is a consistent copy of every record flushed before the copy; what the gateways
hold in memory (up to `prediction_log.flush_interval_ms`) is not in it. A file merged away
while it is copied is skipped, and the merged file taken instead.

A restore puts back each backed-up file whose records the log no longer holds: a file is
held when a live file of the same gateway covers its flush numbers and its time range (the
file itself, or a merge of it). The files put back go into `<gateway>.restored/`, a folder
no gateway writes, because a gateway that lost its folder numbers its flushes from 1 again
and its new files would otherwise be taken for merges of the old ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servemesh.predlog.parquet_store import PartFile, instance_files, live_files, part_file
from servemesh.recovery.checksums import (
    BackupDamaged,
    CopiedFile,
    copy_hashed,
    verified_files,
    write_part_manifest,
)

RESTORED_SUFFIX = ".restored"


@dataclass(frozen=True)
class PredictionsBackup:
    files: int
    bytes: int
    manifest_sha256: str


@dataclass(frozen=True)
class PredictionsRestored:
    files: int
    already_there: int


def back_up_predictions(root: Path, part: Path) -> PredictionsBackup:
    """Copy every live file under `root` (`<state_dir>/predictions`) into `part`."""
    part.mkdir(parents=True, exist_ok=True, mode=0o700)
    copied: dict[str, CopiedFile] = {}
    for _attempt in range(3):  # a merge during the walk: walk again for the merged files
        missed = False
        for found in live_files(root):
            relative = f"{found.path.parent.name}/{found.path.name}"
            if relative in copied:
                continue
            try:
                copied[relative] = copy_hashed(found.path, part, relative)
            except FileNotFoundError:
                missed = True
        if not missed:
            break
    files = sorted(copied.values(), key=lambda f: f.path)
    digest = write_part_manifest(part, files, store="parquet")
    return PredictionsBackup(len(files), sum(f.bytes for f in files), digest)


def verify_predictions(part: Path) -> list[CopiedFile]:
    _summary, files = verified_files(part)
    return files


def _covers(live: PartFile, backed: PartFile) -> bool:
    return (
        live.first <= backed.first
        and live.last >= backed.last
        and live.min_ms <= backed.min_ms
        and live.max_ms >= backed.max_ms
    )


def _from_name(path: Path) -> PartFile:
    found = part_file(path)
    if found is None:
        raise BackupDamaged(f"{path.name}: not a prediction log file's name")
    return found


def restore_predictions(part: Path, root: Path, files: list[CopiedFile]) -> PredictionsRestored:
    """Put back (into `<gateway>.restored/` under `root`) each verified file whose records
    the log no longer holds."""
    put = held = 0
    for entry in files:
        gateway, _, name = entry.path.partition("/")
        backed = _from_name(part / entry.path)
        live = instance_files(root / gateway) + instance_files(root / f"{gateway}{RESTORED_SUFFIX}")
        if any(_covers(f, backed) for f in live):
            held += 1
            continue
        copy_hashed(part / entry.path, root, f"{gateway}{RESTORED_SUFFIX}/{name}")
        put += 1
    return PredictionsRestored(put, held)
