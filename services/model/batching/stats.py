"""The batcher's counters and histograms: what OIP statistics and /metrics report."""

from __future__ import annotations

import bisect
import collections
import time
from dataclasses import dataclass, field

# Histogram bounds (Prometheus `le`) for the metrics endpoint.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass
class Duration:
    """A count and the nanoseconds they took together (OIP's StatisticDuration)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)


@dataclass
class Buckets:
    """A histogram in Prometheus' shape: counts per upper bound (last one +Inf), sum, count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


@dataclass
class BatchSizeStats:
    """Model calls of one batch size (Triton's per-batch-size statistics)."""

    executions: int = 0
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class BatcherStats:
    """Counters for tests, OIP ModelStatistics and the Prometheus endpoint.

    Triton's convention: `inference_count` counts rows answered, `executions` counts model
    calls (including the extra calls that isolate a failing request), so the mean batch size
    is inference_count / executions. Per-request durations (success, fail, queue, compute_*)
    count requests, each charged the whole time of the batch it rode in; `fail` counts every
    request answered with an error (shed, refused, expired, failed). `outcomes` counts them
    by kind: ok, shed, refused (deadline cannot be met), expired, late (deadline passed during
    inference), cancelled, failed, closed. `expired_computed` counts requests that reached
    the model although their deadline had passed (only a deadline-blind batcher does that).
    Histograms: rows per model call (count = executions, sum = rows computed), seconds
    each computed request waited in the queue, seconds per successful model call.
    """

    executions: int = 0
    inference_count: int = 0
    expired_computed: int = 0
    last_inference_ms: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batch_sizes: dict[int, BatchSizeStats] = field(default_factory=dict)
    batch_size_hist: Buckets = field(default_factory=lambda: Buckets(BATCH_SIZE_BUCKETS))
    queue_wait_hist: Buckets = field(default_factory=lambda: Buckets(SECONDS_BUCKETS))
    compute_hist: Buckets = field(default_factory=lambda: Buckets(SECONDS_BUCKETS))

    def for_size(self, size: int) -> BatchSizeStats:
        stats = self.batch_sizes.get(size)
        if stats is None:
            stats = self.batch_sizes[size] = BatchSizeStats()
        return stats

    def record_batch(
        self, size: int, answered: int, *, input_s: float, infer_s: float, output_s: float
    ) -> None:
        """A successful model call of `size` rows that answered `answered` requests: each
        request is charged the call's whole times, the batch size its own."""
        self.compute_input.add(input_s * answered, answered)
        self.compute_infer.add(infer_s * answered, answered)
        self.compute_output.add(output_s * answered, answered)
        per_size = self.for_size(size)
        per_size.executions += 1
        per_size.compute_input.add(input_s)
        per_size.compute_infer.add(infer_s)
        per_size.compute_output.add(output_s)
        self.last_inference_ms = int(time.time() * 1000)  # a wall-clock timestamp (OIP)
