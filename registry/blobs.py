"""Content-addressed artifact files: root/blobs/sha256/<first 2 hex>/<hex>.

A blob is written to a temp file under root/tmp (the same filesystem, so the final rename
is atomic), hashed as it grows, fsynced, then renamed into place. A reader therefore sees
a whole, verified file at a content address or nothing.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".part"


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StagedBlob:
    """A temp file being filled; deleted by `discard` unless the store installed it."""

    def __init__(self, tmp_dir: Path) -> None:
        fd, name = tempfile.mkstemp(dir=tmp_dir, prefix="upload-", suffix=TEMP_SUFFIX)
        self.path = Path(name)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            raise RuntimeError("staged blob is sealed or discarded")
        self._file.write(chunk)
        self._hash.update(chunk)
        self.size += len(chunk)

    def hexdigest(self) -> str:
        """The sha256 of every byte written so far."""
        return self._hash.hexdigest()

    def seal(self) -> None:
        """Flush and fsync: after this the bytes are on disk, ready to be installed."""
        if self._file is None:
            raise RuntimeError("staged blob is sealed or discarded")
        file, self._file = self._file, None
        try:
            file.flush()
            os.fsync(file.fileno())
        finally:
            file.close()

    def discard(self) -> None:
        """Close and delete the temp file; safe to call any number of times."""
        if self._file is not None:
            file, self._file = self._file, None
            file.close()
        self.path.unlink(missing_ok=True)


class BlobStore:
    """Artifact files addressed by their sha256."""

    def __init__(self, root: Path) -> None:
        self.blob_dir = root / "blobs" / "sha256"
        self.tmp_dir = root / "tmp"
        self.blob_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.tmp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path_of(self, sha256: str) -> Path:
        return self.blob_dir / sha256[:2] / sha256

    def stage(self) -> StagedBlob:
        return StagedBlob(self.tmp_dir)

    def sweep_temp(self) -> int:
        """Delete temp files a crashed process left behind; returns how many."""
        removed = 0
        for path in self.tmp_dir.glob(f"*{TEMP_SUFFIX}"):
            path.unlink(missing_ok=True)
            removed += 1
        return removed

    def install(self, staged: StagedBlob, sha256: str) -> bool:
        """Rename a sealed, verified temp file to its content address.

        Returns True when no file was at that address before (the caller must remove it
        again if what references it fails to commit). An existing file is replaced: the
        bytes are equal by construction, and replacing heals a damaged copy.
        """
        dest = self.path_of(sha256)
        new_dir = not dest.parent.exists()
        dest.parent.mkdir(exist_ok=True, mode=0o700)
        existed = dest.exists()
        # Artifacts are immutable; read-only files guard against accidental edits. The
        # owner's alone: an artifact is code, and may be a secret of the operator's.
        os.chmod(staged.path, 0o400)
        os.replace(staged.path, dest)
        _fsync_dir(dest.parent)
        if new_dir:
            _fsync_dir(self.blob_dir)
        return not existed

    def remove(self, sha256: str) -> None:
        self.path_of(sha256).unlink(missing_ok=True)

    def open(self, sha256: str) -> BinaryIO:
        """The blob opened for reading; FileNotFoundError when it is not there."""
        return open(self.path_of(sha256), "rb")
