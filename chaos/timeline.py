"""A drill's timeline: fault windows and marks, on the clock of its load.

Time zero is the first request of the drill's load; every window, mark and the guard's
abort use that clock, which is the clock of the report's timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class FaultWindow:
    key: str
    label: str
    start_s: float
    end_s: float | None = None


@dataclass
class Mark:
    at_s: float
    label: str
    kind: str = "activity"  # activity, phase, guard


@dataclass
class Timeline:
    """Windows while a fault is in place (keyed, so its restore closes the right one) and
    marks for what happened when."""

    # Seconds since the load's first request (0 before the load starts).
    clock: Callable[[], float]
    windows: list[FaultWindow] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    def now_s(self) -> float:
        return self.clock()

    def _stamp(self) -> float:
        return round(self.clock(), 3)

    def mark(self, label: str, kind: str = "activity") -> None:
        self.marks.append(Mark(self._stamp(), label, kind))

    def open_window(self, key: str, label: str) -> None:
        """Open a window unless one with this key is open already (a fault applied twice)."""
        if any(w.key == key and w.end_s is None for w in self.windows):
            return
        self.windows.append(FaultWindow(key, label, self._stamp()))

    def close_window(self, key: str) -> None:
        for window in self.windows:
            if window.key == key and window.end_s is None:
                window.end_s = self._stamp()

    def close_windows(self, prefix: str) -> None:
        for window in self.windows:
            if window.key.startswith(prefix) and window.end_s is None:
                window.end_s = self._stamp()

    def close_all(self, end_s: float) -> None:
        """At the end of the drill: what no restore closed ends here, and says so."""
        for window in self.windows:
            if window.end_s is None:
                window.end_s = end_s
                window.label += " (still open at the end)"

    def open_labels(self) -> list[str]:
        return [w.label for w in self.windows if w.end_s is None]

    def spans(self, now_s: float) -> list[tuple[float, float]]:
        """(start, end) of every window; an open one ends at now_s."""
        return [(w.start_s, w.end_s if w.end_s is not None else now_s) for w in self.windows]
