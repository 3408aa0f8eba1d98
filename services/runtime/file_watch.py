"""Waking when one file changes, by inotify, instead of a stat loop.

Every service follows two files (the live spec, the fault control file). Polling them ten
times a second each woke every idle process twenty times a second: most of an idle
service's CPU went to waking up. The kernel tells of the change instead: the file's folder
is watched (files are replaced by an atomic rename, which a watch on the file itself would
lose), and a wait returns on any event naming the file. A slow poll stays as the safety
net (`fallback_s`), for what inotify cannot see (a folder replaced, a watch limit reached),
and the caller still compares the file's stamp itself: an event only says "look now".
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from inotify_simple import INotify, flags

log = logging.getLogger(__name__)

# Written in place, replaced by a rename, created, removed, or its mode or time changed.
CHANGES = (
    flags.CLOSE_WRITE
    | flags.MOVED_TO
    | flags.MOVED_FROM
    | flags.CREATE
    | flags.DELETE
    | flags.ATTRIB
    | flags.MODIFY
)


class FileEvents:
    """`wait(timeout_s)` returns once `path` may have changed since the last wait, or after
    `timeout_s`; without inotify (no folder yet, no watch left) it is a plain sleep of
    `poll_s`. Open it inside the running loop; `close()` when done."""

    def __init__(self, path: Path, poll_s: float = 0.1) -> None:
        self.path = path
        self.poll_s = poll_s
        self._changed = asyncio.Event()
        self._inotify: INotify | None = None
        self._name = path.name
        try:
            inotify = INotify(nonblocking=True)
        except OSError as exc:
            log.warning("no inotify, polling %s: %s", path, exc)
            return
        try:
            inotify.add_watch(str(path.parent), CHANGES)
        except OSError as exc:
            inotify.close()
            log.info("cannot watch %s, polling it: %s", path.parent, exc)
            return
        self._inotify = inotify
        asyncio.get_running_loop().add_reader(inotify.fileno(), self._readable)

    @property
    def watching(self) -> bool:
        """Whether the kernel tells of changes (else the wait polls)."""
        return self._inotify is not None

    def _readable(self) -> None:
        assert self._inotify is not None
        try:
            events = self._inotify.read(timeout=0)
        except OSError:
            return
        if any(event.name == self._name or event.mask & flags.IGNORED for event in events):
            self._changed.set()

    async def wait(self, timeout_s: float) -> None:
        if self._inotify is None:
            await asyncio.sleep(self.poll_s)
            return
        try:
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()
        except TimeoutError:
            pass
        self._changed.clear()

    def close(self) -> None:
        if self._inotify is not None:
            asyncio.get_running_loop().remove_reader(self._inotify.fileno())
            self._inotify.close()
            self._inotify = None
