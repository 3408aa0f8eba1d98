"""A stream's lag and throughput: Prometheus metrics of the consumer, and what
`servemesh stream status` reads from Redis itself (no consumer needed).

    servemesh_stream_events_total{stream,outcome}   predicted | dead_lettered | redelivered
    servemesh_stream_retries_total{stream,code}     transient failures (the batch stays pending)
    servemesh_stream_pending_entries{stream}        delivered, not yet acknowledged
    servemesh_stream_oldest_pending_age_seconds{stream}
    servemesh_stream_undelivered_entries{stream}    in the stream, not yet read by the group
    servemesh_stream_events_per_second{stream}      over the last RATE_WINDOW_S
    servemesh_stream_event_to_prediction_seconds{stream}   histogram: input id to output id
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from servemesh.streams.keys import StreamKeys, id_ms, text

RATE_WINDOW_S = 5.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class Lag:
    """How far the group is behind, read from Redis."""

    length: int  # entries in the input stream
    pending: int  # delivered to a consumer, not acknowledged
    oldest_pending_age_s: float  # of the oldest pending entry, by its id's time; 0: none
    undelivered: int | None  # not read by the group yet (None: Redis could not say)
    consumers: int
    output_length: int
    dead_letters: int

    @property
    def settled(self) -> bool:
        """Every entry read and acknowledged: nothing pending, nothing undelivered."""
        return self.pending == 0 and self.undelivered == 0

    @classmethod
    def from_replies(
        cls,
        pending: Mapping[str, Any],
        groups: list[Mapping[str, Any]],
        group: str,
        lengths: tuple[int, int, int],
        now_ms: int,
    ) -> Lag:
        oldest = pending.get("min")
        count = int(pending.get("pending") or 0)
        age = max(0.0, (now_ms - id_ms(oldest)) / 1000) if count and oldest else 0.0
        info = next((g for g in groups if text(g.get("name", b"")) == group), {})
        lag = info.get("lag")
        return cls(
            length=lengths[0],
            pending=count,
            oldest_pending_age_s=age,
            undelivered=int(lag) if lag is not None else None,
            consumers=int(info.get("consumers") or 0),
            output_length=lengths[1],
            dead_letters=lengths[2],
        )


def _queue_lag(pipe: Any, keys: StreamKeys) -> None:
    pipe.xinfo_groups(keys.input).xpending(keys.input, keys.group)
    pipe.xlen(keys.input).xlen(keys.output).xlen(keys.dead_letter).time()


def _lag_of(replies: list[Any], keys: StreamKeys) -> Lag | None:
    groups, pending, n_in, n_out, n_dead, now = replies
    if not any(text(g.get("name", b"")) == keys.group for g in groups):
        return None
    now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
    return Lag.from_replies(pending, groups, keys.group, (n_in, n_out, n_dead), now_ms)


# The group's lag and its pending entries are read in one MULTI: read one after the other,
# a batch the consumer takes between the two reads is in neither (not pending yet when
# XPENDING ran, no longer undelivered when XINFO did), and a stream looks settled while
# that batch is still being scored.


async def read_lag(client: Any, keys: StreamKeys) -> Lag | None:
    """The group's lag, one consistent reading (None: no such stream or group yet).
    `client`: redis.asyncio."""
    import redis

    async with client.pipeline(transaction=True) as pipe:
        _queue_lag(pipe, keys)
        try:
            replies = await pipe.execute()
        except redis.ResponseError:
            return None  # no such stream, or no such group
    return _lag_of(replies, keys)


def read_lag_now(client: Any, keys: StreamKeys) -> Lag | None:
    """As `read_lag`, for a blocking `redis.Redis` (drills, benchmarks, tests)."""
    import redis

    with client.pipeline(transaction=True) as pipe:
        _queue_lag(pipe, keys)
        try:
            replies = pipe.execute()
        except redis.ResponseError:
            return None
    return _lag_of(replies, keys)


class StreamMetrics:
    """The consumer's metrics, in a registry of its own (its /metrics)."""

    def __init__(self, stream: str, registry: CollectorRegistry | None = None) -> None:
        self.stream = stream
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events = Counter(
            "servemesh_stream_events", "Events handled, by outcome", ["stream", "outcome"],
            registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "servemesh_stream_retries", "Batches left pending by a transient failure",
            ["stream", "code"], registry=r,
        )  # fmt: skip
        self.pending = Gauge(
            "servemesh_stream_pending_entries", "Delivered, not yet acknowledged", ["stream"],
            registry=r,
        )  # fmt: skip
        self.oldest_pending = Gauge(
            "servemesh_stream_oldest_pending_age_seconds",
            "Age of the oldest pending entry (by its id)", ["stream"], registry=r,
        )  # fmt: skip
        self.undelivered = Gauge(
            "servemesh_stream_undelivered_entries", "Entries the group has not read yet",
            ["stream"], registry=r,
        )  # fmt: skip
        self.rate = Gauge(
            "servemesh_stream_events_per_second", f"Events handled over the last {RATE_WINDOW_S}s",
            ["stream"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "servemesh_stream_event_to_prediction_seconds",
            "From the input entry's id to its output entry's id", ["stream"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.counts: dict[str, int] = {"predicted": 0, "dead_lettered": 0, "redelivered": 0}
        self.retry_count = 0
        self._window: deque[tuple[float, int]] = deque()

    def handled(self, outcome: str, n: int) -> None:
        if n:
            self.events.labels(self.stream, outcome).inc(n)
            self.counts[outcome] = self.counts.get(outcome, 0) + n

    def batch_done(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._window.append((now, n))
        self.events_per_second(now)

    def events_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()
        rate = sum(n for _, n in self._window) / RATE_WINDOW_S
        self.rate.labels(self.stream).set(rate)
        return rate

    def retried(self, code: str) -> None:
        self.retries.labels(self.stream, code).inc()
        self.retry_count += 1

    def observe_lag(self, lag: Lag) -> None:
        self.pending.labels(self.stream).set(lag.pending)
        self.oldest_pending.labels(self.stream).set(lag.oldest_pending_age_s)
        if lag.undelivered is not None:
            self.undelivered.labels(self.stream).set(lag.undelivered)
