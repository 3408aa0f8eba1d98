"""Deadline-aware dynamic batching for one loaded (model, version).

Modelled on Ray Serve's batcher - a small record per queued request, one loop that forms
batches and recomputes how long it may still wait, every waiter of a failed batch told -
with what Ray lacks: deadlines, priorities, load shedding and failure isolation.

| module | its one job |
| --- | --- |
| `batcher` | Batcher: admission, dispatch policy, running batches, splitting failed ones |
| `queues` | the record of one queued request; per-priority queues in deadline order |
| `rows` | what is batched: one array, or NamedRows for multi-tensor models; join and cut |
| `overlap` | ArrivalOverlap: whether arrivals overlap (adaptive dispatch waits then) |
| `worker` | the thread that runs the model, results back as asyncio futures |
| `stats` | counters and histograms read by OIP statistics and /metrics |
| `clock` | Clock: where every decision reads time; ManualClock for tests |
"""

from __future__ import annotations

from servemesh.services.model.batching.batcher import (
    DISPATCH_SLACK_S,
    DISPATCH_SLACK_SHARE,
    Batcher,
    BatchRunner,
)
from servemesh.services.model.batching.clock import (
    MONOTONIC,
    Clock,
    ManualClock,
    MonotonicClock,
    Timer,
)
from servemesh.services.model.batching.overlap import ArrivalOverlap
from servemesh.services.model.batching.rows import NamedRows, Rows, cut_rows, join_rows, row_count
from servemesh.services.model.batching.stats import (
    BatcherStats,
    BatchSizeStats,
    Buckets,
    Duration,
)

__all__ = [
    "DISPATCH_SLACK_S",
    "DISPATCH_SLACK_SHARE",
    "MONOTONIC",
    "ArrivalOverlap",
    "BatchRunner",
    "BatchSizeStats",
    "Batcher",
    "BatcherStats",
    "Buckets",
    "Clock",
    "Duration",
    "ManualClock",
    "MonotonicClock",
    "NamedRows",
    "Rows",
    "Timer",
    "cut_rows",
    "join_rows",
    "row_count",
]
