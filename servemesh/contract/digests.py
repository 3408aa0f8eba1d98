"""A file's sha256, read in blocks: what artifacts, backups and synced folders are checked
against."""

from __future__ import annotations

import hashlib
from pathlib import Path

_BLOCK = 1024 * 1024


def file_sha256(path: Path) -> str:
    """The hex sha256 of the file at `path`, read a block at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()
