"""The drill's guard: stop injecting as soon as callers suffer more than the drill allows.

While armed (during the method), a thread reads the load's last `for_s` seconds four times
a second; when success falls below `min_success_pct` (or p99 rises above `max_p99_ms`),
it trips once: it records why and when, and sets `abort`, which the control turns into an
interruption of the method, so the rollbacks run at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.25


class Window(Protocol):
    """What the guard reads of a window of the load."""

    @property
    def sent(self) -> int: ...

    @property
    def success_pct(self) -> float: ...

    @property
    def p99_ms(self) -> float: ...


class Load(Protocol):
    """The drill's load, as the guard reads it."""

    @property
    def rate_per_s(self) -> float: ...

    def last(self, seconds: float) -> Window: ...


class Guard:
    def __init__(
        self,
        min_success_pct: float,
        for_s: float,
        max_p99_ms: float,
        on_trip: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.min_success_pct = min_success_pct
        self.for_s = for_s
        self.max_p99_ms = max_p99_ms  # 0: no latency guard
        self.armed = False
        self.tripped = False
        self.reason = ""
        self.at_s: float | None = None
        # Set when the guard trips (or the drill is told to stop): waits wake at once.
        self.abort = threading.Event()
        # Called with the reason when it trips (the drill marks its timeline).
        self._on_trip = on_trip
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def judge(self, stats: Window, rate_per_s: float) -> str:
        """Why the guard must trip on this window, or "" when it holds (or the window is
        too thin to mean anything yet)."""
        if stats.sent < max(10, 0.5 * rate_per_s * self.for_s):
            return ""
        if stats.success_pct < self.min_success_pct:
            return (
                f"success {stats.success_pct:.1f}% < {self.min_success_pct:g}% "
                f"over the last {self.for_s:g} s"
            )
        if self.max_p99_ms and stats.p99_ms > self.max_p99_ms:
            return (
                f"p99 {stats.p99_ms:.0f} ms > {self.max_p99_ms:g} ms over the last {self.for_s:g} s"
            )
        return ""

    def trip(self, reason: str, at_s: float) -> None:
        if self.abort.is_set():
            return
        self.tripped = True
        self.reason = reason
        self.at_s = round(at_s, 3)
        self._on_trip(reason)
        log.warning("drill guard tripped: %s", reason)
        self.abort.set()

    def watch(self, load: Load, clock: Callable[[], float]) -> None:
        """Start judging `load` in a thread of its own, until close()."""
        self._thread = threading.Thread(
            target=self._loop, args=(load, clock), name="drill-guard", daemon=True
        )
        self._thread.start()

    def _loop(self, load: Load, clock: Callable[[], float]) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            if not self.armed or self.abort.is_set():
                continue
            reason = self.judge(load.last(self.for_s), load.rate_per_s)
            if reason:
                self.trip(reason, clock())

    def close(self) -> None:
        self._stop.set()
