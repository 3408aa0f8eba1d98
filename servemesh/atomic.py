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
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
