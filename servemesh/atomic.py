"""Atomic file replacement: readers (Envoy, replicas, operators) never see half a file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it into place.

    The temporary file lives in the same folder (same filesystem, so the rename is atomic)
    under a dot-name that watchers of `path` never read.
    """
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` atomically as `atomic_write_text` does, flushed to disk first. The file
    is created owner-only and takes `mode` before it appears under its name, so a secret is
    never readable by others, even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode != 0o600:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
