"""Follow the running mesh's resolved spec: a service sees what `servemesh apply` changed.

Every service process starts from the resolved spec file the launcher wrote. A live change
(`servemesh apply`: a model, a version or a feature view added or removed, weights moved)
rewrites that file atomically; each service polls it and, when it changed and still parses,
hands the new spec to the hooks its builder registered (the gateway's model table, the
feature service's views, the model server's routed versions). A file that does not parse is
logged and ignored: the service keeps the last good spec rather than serving nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from servemesh.spec import ResolvedSpec, SpecError, load_resolved

log = logging.getLogger(__name__)

SpecHook = Callable[[ResolvedSpec], Awaitable[None]]

# (inode, size, mtime_ns): an atomic rename changes the inode even within one mtime tick.
_Stamp = tuple[int, int, int]


def _stamp(path: Path) -> _Stamp | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return (info.st_ino, info.st_size, info.st_mtime_ns)


class LiveSpec:
    """The current resolved spec of one service, re-read when its file changes."""

    def __init__(self, path: Path, initial: ResolvedSpec, *, interval_s: float = 0.1) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self._current = initial
        self._seen = _stamp(self.path)
        self._hooks: list[SpecHook] = []
        self._lock = asyncio.Lock()
        self.generation = 0

    @property
    def current(self) -> ResolvedSpec:
        return self._current

    def on_change(self, hook: SpecHook) -> None:
        """Call `hook(new_spec)` after every change, in registration order."""
        self._hooks.append(hook)

    async def refresh(self) -> bool:
        """Re-read the file if it changed; True when a new spec was taken."""
        async with self._lock:
            stamp = _stamp(self.path)
            if stamp is None or stamp == self._seen:
                return False
            self._seen = stamp
            try:
                spec = await asyncio.to_thread(load_resolved, self.path)
            except (OSError, SpecError) as exc:
                log.warning(
                    "spec change ignored: the file does not parse",
                    extra={"path": str(self.path), "error": str(exc)[:500]},
                )
                return False
            if spec == self._current:
                return False
            self._current = spec
            self.generation += 1
            log.info("spec changed", extra={"generation": self.generation})
            for hook in self._hooks:
                try:
                    await hook(spec)
                except Exception:  # one failing hook must not keep the others from running
                    log.exception("spec change hook failed")
            return True

    async def watch(self) -> None:
        """Poll until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()
