"""A load run as it happens: its clock, its outcomes, and what was done to the system
under load meanwhile (events), readable from other threads while it runs."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servemesh.load.outcome import Outcome
from servemesh.load.stats import window


@dataclass(frozen=True)
class Event:
    """Something to do while the load runs (kill a replica, change weights, snapshot a
    server's counters), `at_s` seconds after time zero. It runs in a worker thread, so the
    load keeps its schedule while it does."""

    at_s: float
    action: Callable[[], Any]
    name: str = ""


@dataclass
class EventRecord:
    name: str
    started_s: float
    finished_s: float
    result: Any = None
    error: str = ""


@dataclass
class LoadRun:
    """`origin` is time zero (a perf_counter() value): every `sent_s`, event time and
    window is on that clock. Outcomes are appended as answers come back, so their order is
    the order of completion; read them through `snapshot` or `window`."""

    origin: float = field(default_factory=time.perf_counter)
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[EventRecord] = field(default_factory=list)
    scheduled: int = 0  # requests that have come due so far

    def now_s(self) -> float:
        return time.perf_counter() - self.origin

    def snapshot(self) -> list[Outcome]:
        """Outcomes so far, ordered by send time (a copy: the load keeps appending)."""
        return sorted(list(self.outcomes), key=lambda o: o.sent_s)

    def window(self, start_s: float, end_s: float = math.inf) -> list[Outcome]:
        """Outcomes of requests due in [start_s, end_s)."""
        return window(list(self.outcomes), start_s, end_s)

    def event(self, name: str) -> EventRecord:
        return next(e for e in self.events if e.name == name)
