"""What an interrupted batch run leaves, and what `--resume` continues from.

A run keeps a folder of its own (0700): `checkpoint.json` (0600, replaced atomically after
every chunk the output holds), `ids.txt` (the ids in scoring order, written once at the
start) and, for Parquet, `parts/` (one file per chunk). The checkpoint says how many chunks
the output holds (`next_chunk`) and their rows; the writer holds those chunks and maybe the
next one, written before a crash could record it. A resumed run has the writer discard
anything from `next_chunk` on, then scores from there: no row twice, no gap.

The folder goes away when the output is in place; a run that starts without `--resume`
discards one left behind (and what its writer staged).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servemesh.batch.errors import BatchError
from servemesh.contract.atomic import atomic_write_bytes
from servemesh.contract.private import private_dir

CHECKPOINT = "checkpoint.json"
IDS = "ids.txt"
FORMAT = 1


@dataclass
class Checkpoint:
    """Where a run stands. `job` names what is being produced: a resumed run must be the
    same job (model version and sha256, source version, chunking, filter, output)."""

    job: dict[str, Any]
    chunks: int
    next_chunk: int = 0
    rows_written: int = 0
    # What the writer staged the output under (a Redis run number, a staging table).
    stage: str = ""
    started_at_ms: int = field(default_factory=lambda: time.time_ns() // 1_000_000)
    updated_at_ms: int = 0

    @property
    def done(self) -> bool:
        return self.next_chunk >= self.chunks


class RunDir:
    """The folder of one job's run in progress."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT

    @property
    def parts(self) -> Path:
        return self.path / "parts"

    def exists(self) -> bool:
        return self.checkpoint_path.is_file()

    def create(self) -> None:
        private_dir(self.path)

    def load(self) -> Checkpoint | None:
        try:
            data = json.loads(self.checkpoint_path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            raise BatchError(
                f"{self.checkpoint_path}: not a checkpoint (unreadable JSON)"
            ) from None
        if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
            raise BatchError(f"{self.checkpoint_path}: not a checkpoint of this version")
        try:
            return Checkpoint(**data)
        except TypeError:
            raise BatchError(f"{self.checkpoint_path}: not a checkpoint (fields)") from None

    def save(self, checkpoint: Checkpoint) -> None:
        checkpoint.updated_at_ms = time.time_ns() // 1_000_000
        data = {"format": FORMAT, **asdict(checkpoint)}
        atomic_write_bytes(self.checkpoint_path, json.dumps(data, indent=1).encode(), mode=0o600)

    def save_ids(self, ids: Sequence[str]) -> None:
        atomic_write_bytes(self.path / IDS, "".join(f"{e}\n" for e in ids).encode(), mode=0o600)

    def load_ids(self) -> list[str]:
        try:
            text = (self.path / IDS).read_text()
        except FileNotFoundError:
            raise BatchError(f"{self.path / IDS}: the interrupted run's ids are gone") from None
        return text.splitlines()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def same_job(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """BatchError naming the first field where a resumed run is not the interrupted one."""
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            raise BatchError(
                f"--resume: {key} was {saved.get(key)!r} in the interrupted run, now "
                f"{now.get(key)!r}; resume with the same flags, or start again without --resume"
            )
