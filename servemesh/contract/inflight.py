"""The in-flight journal: what a model server is computing, readable after it crashed.

A model server keeps one file, `<state_dir>/inflight/<instance>.inflight`, with a slot of
SLOT_BYTES per model thread (one per loaded version). Before each forward pass the thread
writes its batch into its slot (model, version, and for every request its request id,
caller and the sha256 of its input payload) with one `pwrite`, and clears it after with
another. A crashed process leaves its slots as they were: the data is in the page cache,
which outlives the process (not the machine), so no flush or fsync is needed, and
`pwrite` moves no file offset, so threads never share one.

    <slot>  := <one JSON line> "\\n" <garbage up to the next slot>   a batch in flight
             | "\\n" ...  or  "\\0" ...                                 nothing in flight

The model server writes (`InflightJournal`, `JournalSlot`); the launcher reads a crashed
instance's slots (`read_inflight`) and then removes the file (`discard`). Slots are never
reused within a process: a version unloaded live may still drain its queue into its slot.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _quoted  # the C encoder: ~0.1 us a string
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

INFLIGHT_DIR = "inflight"
SUFFIX = ".inflight"
# One slot per model thread. A call's line is ~230 bytes (a 128-character request id at
# most): 64 calls fit; a larger batch records its first calls and how many it left out.
SLOT_BYTES = 16384
_CLEAR = b"\n"

# A call in flight: (request id, caller, sha256 of its input payload, hex).
Call = tuple[str, str, str]


def journal_path(state_dir: str | Path, instance: str) -> Path:
    return Path(state_dir) / INFLIGHT_DIR / f"{instance}{SUFFIX}"


class JournalSlot:
    """One model thread's slot: `begin` before the forward pass, `end` after."""

    __slots__ = ("_fd", "_offset", "_head")

    def __init__(self, fd: int, offset: int, model: str, version: str) -> None:
        self._fd = fd
        self._offset = offset
        # The line's unchanging start, encoded once.
        self._head = f'{{"model":{_quoted(model)},"version":{_quoted(version)},"calls":['

    def begin(self, calls: Sequence[Call]) -> None:
        """Record `calls` as in flight (one write). Never raises: a journal that cannot be
        written must not fail the batch."""
        # Formatted by hand: json.dumps of the same list costs several times as much, and
        # this runs before every forward pass.
        parts = [
            f'{{"request_id":{_quoted(request_id)},"caller":{_quoted(caller)},"sha256":"{digest}"}}'
            for request_id, caller, digest in calls
        ]
        line = f"{self._head}{','.join(parts)}]}}\n".encode()
        if len(line) > SLOT_BYTES:
            line = self._cut(parts)
        try:
            os.pwrite(self._fd, line, self._offset)
        except OSError:
            pass  # a full disk: the crash goes unattributed, the batch is served

    def end(self) -> None:
        """Nothing in flight any more."""
        try:
            os.pwrite(self._fd, _CLEAR, self._offset)
        except OSError:
            pass

    def _cut(self, parts: list[str]) -> bytes:
        """The first calls that fit, and how many were left out (a very large batch)."""
        room = SLOT_BYTES - len(self._head) - 64
        kept: list[str] = []
        used = 0
        for part in parts:
            if used + len(part) + 1 > room:
                break
            kept.append(part)
            used += len(part) + 1
        more = len(parts) - len(kept)
        return f'{self._head}{",".join(kept)}],"more":{more}}}\n'.encode()


class NoSlot:
    """A slot of a journal that could not be opened: records nothing."""

    __slots__ = ()

    def begin(self, calls: Sequence[Call]) -> None:
        pass

    def end(self) -> None:
        pass


class InflightJournal:
    """A model server's journal file; a slot per model thread (`slot`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._next = 0
        self._fd: int | None = None
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            # Truncated: slots of an earlier process of this instance (already read by the
            # launcher at its crash) never show as this one's.
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
            self._fd = os.open(path, flags, 0o600)
        except OSError as exc:
            log.warning("no in-flight journal: crashes go unattributed: %s", exc)

    def slot(self, model: str, version: str) -> JournalSlot | NoSlot:
        if self._fd is None:
            return NoSlot()
        with self._lock:
            offset = self._next * SLOT_BYTES
            self._next += 1
        try:
            os.pwrite(self._fd, _CLEAR, offset)
        except OSError:
            return NoSlot()
        return JournalSlot(self._fd, offset, model, version)

    def close(self) -> None:
        """The server stops on purpose: nothing of it is in flight."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)
        self.path.unlink(missing_ok=True)


def read_inflight(path: Path) -> list[dict[str, Any]]:
    """The batches a crashed process left in flight: one entry per slot with a batch
    (model, version, calls: request_id, caller, sha256; `more` when calls were left out).
    [] when the file is missing; an unreadable slot is skipped."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: list[dict[str, Any]] = []
    for offset in range(0, len(data), SLOT_BYTES):
        line = data[offset : offset + SLOT_BYTES].split(b"\n", 1)[0].strip(b"\0")
        if not line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("calls"), list):
            found.append(entry)
    return found


def discard(path: Path) -> None:
    """Remove a crashed process's journal once read (its next process starts a new one)."""
    path.unlink(missing_ok=True)
