"""Atomic file replacement: readers (Envoy, replicas, operators) never see half a file."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

# What a replacement may keep of the file it replaces: its owner's and its group's bits,
# never others'.
_KEPT_BITS = 0o770


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it into place.

    The temporary file lives in the same folder (same filesystem, so the rename is atomic)
    under a dot-name that watchers of `path` never read.
    """
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` atomically as `atomic_write_text` does, flushed to disk first.

    The file is created owner-only (whatever the umask) and takes its mode before it
    appears under its name, so a secret is never readable by others, even for a moment.
    `mode` None: 0600 for a new file; a replacement keeps the group and mode of the file it
    replaces (less any bits for others), so a file shared with one group on purpose (the
    resolved spec, with the model servers' group) stays shared after a rewrite. A new file in
    a setgid folder readable by its group is 0640: such a folder shares its files.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
            _settle(handle.fileno(), path, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _settle(fd: int, path: Path, mode: int | None) -> None:
    """Give the open temporary file `fd` the mode (and group) `path` is to have."""
    if mode is not None:
        os.fchmod(fd, mode)
        return
    try:
        old = os.stat(path)
    except FileNotFoundError:
        folder = os.stat(path.parent)
        shared = folder.st_mode & stat.S_ISGID and folder.st_mode & stat.S_IRGRP
        os.fchmod(fd, 0o640 if shared else 0o600)
        return
    if old.st_gid != os.fstat(fd).st_gid:
        try:
            os.fchown(fd, -1, old.st_gid)
        except PermissionError:  # a group this user is not in: the file stays private
            os.fchmod(fd, 0o600)
            return
    os.fchmod(fd, stat.S_IMODE(old.st_mode) & _KEPT_BITS)
