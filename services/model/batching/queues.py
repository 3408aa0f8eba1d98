"""Queued requests: one record per request, one list per priority level, in serving order.

Priority levels are strict (a lower value is served first). Within a level, requests are
kept earliest deadline first, FIFO among equal deadlines (`by_deadline=True`), or in
arrival order alone (`by_deadline=False`, the deadline-blind baseline).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from servemesh.services.model.batching.clock import Timer
from servemesh.services.model.batching.rows import Rows


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False, slots=True)
class Pending:
    """One request from admission to answer."""

    rows: Rows
    n_rows: int
    deadline: float  # on the batcher's clock
    request_id: str
    priority: int
    enqueued: float
    future: asyncio.Future[Rows]
    seq: int = 0  # arrival order, set by RequestQueue.push: ties in deadline go first come first
    state: State = State.QUEUED
    dispatched: float = 0.0
    timer: Timer | None = None
    # The request's own span (its server span): its batch links to it.
    span: trace.Span = trace.INVALID_SPAN
    # Who sent it (the in-flight journal names it when the process crashes mid-batch).
    caller: str = ""


def _edf_key(item: Pending) -> tuple[float, int]:
    return (item.deadline, item.seq)


def _fifo_key(item: Pending) -> int:
    return item.seq


class RequestQueue:
    """The requests waiting for a batch, by priority level; counts requests and rows."""

    def __init__(self, *, by_deadline: bool) -> None:
        self._by_deadline = by_deadline
        self._key: Callable[[Pending], Any] = _edf_key if by_deadline else _fifo_key
        # One list per priority level, sorted by _key; holds queued requests only.
        self._levels: dict[int, list[Pending]] = {}
        self._seq = 0
        self.waiting = 0  # requests queued
        self.rows = 0  # rows queued

    def push(self, item: Pending) -> None:
        """Queue `item` at its place in its level; stamps its arrival order."""
        self._seq += 1
        item.seq = self._seq
        level = self._levels.get(item.priority)
        if level is None:
            self._levels[item.priority] = [item]
        elif self._by_deadline and level[-1].deadline > item.deadline:
            bisect.insort(level, item, key=_edf_key)
        else:
            level.append(item)
        self.waiting += 1
        self.rows += item.n_rows

    def remove(self, item: Pending) -> None:
        """Take one queued request out (expired or withdrawn before its batch formed)."""
        level = self._levels.get(item.priority)
        if level is not None:
            at = bisect.bisect_left(level, self._key(item), key=self._key)
            if at < len(level) and level[at] is item:
                del level[at]
                if not level:
                    del self._levels[item.priority]
        self.waiting -= 1
        self.rows -= item.n_rows

    def candidate(self, limit: int) -> tuple[list[Pending], bool]:
        """The requests a batch of at most `limit` rows would take now, and whether it can
        no longer grow. Always a prefix of each level's list, levels in order."""
        chosen: list[Pending] = []
        rows = 0
        for priority in sorted(self._levels):
            for item in self._levels[priority]:
                if not chosen and item.n_rows >= limit:
                    # A request larger than a batch (max_rows_per_request may exceed
                    # max_batch_size) runs alone rather than being split.
                    return [item], True
                if rows + item.n_rows > limit:
                    return chosen, True
                chosen.append(item)
                rows += item.n_rows
                if rows == limit:
                    return chosen, True
        return chosen, False

    def take(self, chosen: list[Pending]) -> None:
        """Take a prefix returned by `candidate` (or a prefix of it) off the queue."""
        per_level = collections.Counter(item.priority for item in chosen)
        for priority, count in per_level.items():
            level = self._levels[priority]
            del level[:count]
            if not level:
                del self._levels[priority]
        self.waiting -= len(chosen)
        self.rows -= sum(item.n_rows for item in chosen)
