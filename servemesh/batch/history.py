"""One record per batch run, in `<state_dir>/batch/history.jsonl` (0600, one JSON object a
line, appended): what `servemesh batch history` prints.

A record: job (a spec job's name, or "" for a run from the command line), model, version,
sha256, rows, seconds, output, source, started_at_ms, finished_at_ms, status ("ok" or
"failed"), error (failed runs).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from servemesh.contract.private import private_dir

HISTORY = Path("batch") / "history.jsonl"


@dataclass(frozen=True)
class RunRecord:
    job: str
    model: str
    version: str
    sha256: str
    rows: int
    seconds: float
    output: str
    source: str
    started_at_ms: int
    finished_at_ms: int
    status: str = "ok"
    error: str = ""


def history_path(state_dir: Path) -> Path:
    return state_dir / HISTORY


def record_run(state_dir: Path, record: RunRecord) -> None:
    """Append `record` (one write of one line: records of concurrent runs never mix)."""
    path = history_path(state_dir)
    private_dir(path.parent)
    line = (json.dumps(asdict(record), separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_history(state_dir: Path, job: str | None = None) -> list[RunRecord]:
    """Every record, oldest first (of `job` only, when given); a torn last line is skipped."""
    path = history_path(state_dir)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            data: dict[str, Any] = json.loads(line)
            record = RunRecord(**data)
        except (ValueError, TypeError):
            continue
        if job is None or record.job == job:
            records.append(record)
    return records
