"""Waking when one file changes, by inotify, instead of a stat loop.

Every service follows two files (the live spec, the fault control file). Polling them ten
times a second each woke every idle process twenty times a second: most of an idle
service's CPU went to waking up. The kernel tells of the change instead: the file's folder
is watched (files are replaced by an atomic rename, which a watch on the file itself would
lose), and a wait returns on any event naming the file. A slow poll stays as the safety
net (`fallback_s`), for what inotify cannot see (a folder replaced, a watch limit reached),
and the caller still compares the file's stamp itself: an event only says "look now".

One inotify instance serves every watch of a process's event loop: instances are counted
per user (128 by default), and each Envoy already holds twenty or more.
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


class _Watches:
    """The loop's one inotify instance and who waits on which file of which folder."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.inotify = INotify(nonblocking=True)
        self.folders: dict[str, int] = {}  # folder -> its watch descriptor
        self.waiting: dict[int, dict[str, set[asyncio.Event]]] = {}  # wd -> name -> events
        loop.add_reader(self.inotify.fileno(), self._readable)

    def add(self, path: Path, event: asyncio.Event) -> None:
        folder = str(path.parent)
        wd = self.folders.get(folder)
        if wd is None:
            wd = self.folders[folder] = self.inotify.add_watch(folder, CHANGES)
            self.waiting[wd] = {}
        self.waiting[wd].setdefault(path.name, set()).add(event)

    def remove(self, path: Path, event: asyncio.Event) -> None:
        folder = str(path.parent)
        wd = self.folders.get(folder)
        if wd is None:
            return
        names = self.waiting[wd]
        names.get(path.name, set()).discard(event)
        if not names.get(path.name):
            names.pop(path.name, None)
        if not names:
            del self.folders[folder], self.waiting[wd]
            try:
                self.inotify.rm_watch(wd)
            except OSError:  # the folder went, and its watch with it
                pass

    def _readable(self) -> None:
        try:
            events = self.inotify.read(timeout=0)
        except OSError:
            return
        for found in events:
            names = self.waiting.get(found.wd, {})
            if found.mask & flags.IGNORED:  # the folder is gone: wake all of it
                for waiting in names.values():
                    for event in waiting:
                        event.set()
                continue
            for event in names.get(found.name, ()):
                event.set()

    def close_if_idle(self) -> bool:
        if self.waiting:
            return False
        self.loop.remove_reader(self.inotify.fileno())
        self.inotify.close()
        return True


_by_loop: dict[asyncio.AbstractEventLoop, _Watches] = {}


class FileEvents:
    """`wait(timeout_s)` returns once `path` may have changed since the last wait, or after
    `timeout_s`; without inotify (no folder yet, no instance or watch left) it is a plain
    sleep of `poll_s`. Open it inside the running loop; `close()` when done."""

    def __init__(self, path: Path, poll_s: float = 0.1) -> None:
        self.path = path
        self.poll_s = poll_s
        self._changed = asyncio.Event()
        self._watches: _Watches | None = None
        loop = asyncio.get_running_loop()
        try:
            watches = _by_loop.get(loop)
            if watches is None:
                watches = _by_loop[loop] = _Watches(loop)
        except OSError as exc:
            log.info("no inotify instance, polling %s: %s", path, exc)
            return
        try:
            watches.add(path, self._changed)
        except OSError as exc:
            log.info("cannot watch %s by inotify, polling it: %s", path, exc)
            if watches.close_if_idle():
                _by_loop.pop(loop, None)
            return
        self._watches = watches

    @property
    def watching(self) -> bool:
        """Whether the kernel tells of changes (else the wait polls)."""
        return self._watches is not None

    async def wait(self, timeout_s: float) -> None:
        if self._watches is None:
            await asyncio.sleep(self.poll_s)
            return
        try:
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()
        except TimeoutError:
            pass
        self._changed.clear()

    def close(self) -> None:
        watches = self._watches
        if watches is None:
            return
        self._watches = None
        watches.remove(self.path, self._changed)
        if watches.close_if_idle():
            _by_loop.pop(watches.loop, None)
