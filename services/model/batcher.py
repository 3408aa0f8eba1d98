"""A deadline-aware dynamic batcher for one loaded (model, version).

Modelled on Ray Serve's batcher - a small record per queued request, one loop that forms
batches and recomputes how long it may still wait, every waiter of a failed batch told -
with what Ray lacks: deadlines, priorities, load shedding and failure isolation.

- `submit` never blocks: a full queue sheds at once with RESOURCE_EXHAUSTED.
- A request whose remaining time is below the expected time of the smallest batch that can
  hold it is refused at once with DEADLINE_EXCEEDED instead of wasting the model on it.
- Expired and cancelled requests never reach the model: a timer fails each request at its
  deadline while it waits and takes it out of the queue.
- Priority levels are strict (a lower value is served first); within a level, requests are
  served earliest deadline first (FIFO among equal timeouts).
- When a batch leaves (`dispatch`): a full batch, or one of the largest preferred size that
  can be formed, leaves at once, as in Triton. Otherwise "fixed_window" waits up to
  `max_queue_delay_ms` after the batch's first request; "adaptive" leaves at once while
  requests do not overlap (few arrive sooner after the previous one than a batch of one takes
  to run: a lone caller, sparse traffic) and waits like fixed_window once they do. Either way
  a batch leaves earlier when waiting longer would make its earliest deadline unreachable.
- The model runs in one dedicated worker thread, off the event loop. While it runs, new
  requests queue up and their delay clocks keep running, so the next batch is ready the
  moment the worker is free.
- A batch that raises is split in halves and retried recursively, so only the culprit
  request(s) fail (INTERNAL, short message; the traceback goes to the log).
- `deadline_policy: ignore` turns all deadline handling off (FIFO, no expiry, cancelled
  requests still computed): the behaviour of a deadline-blind batcher, kept so that a
  benchmark can compare the two on the same server. `stats.expired_computed` counts the
  requests that reached the model after their deadline (always 0 under "enforce").
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from servemesh.services.model.errors import DeadlineMissed, InferenceFailed, QueueFull, Unavailable
from servemesh.services.model.latency import LatencyTable
from servemesh.spec import BatchingSpec

log = logging.getLogger(__name__)

# A batch leaves this much before the latest moment that still meets its earliest deadline
# (plus a share of its expected time, for forward passes slowed by cold caches), to cover
# event loop timers that fire a millisecond or two late on a busy box. Sending the answer
# is already covered by the servicer's hop budget. A wider margin is not safer: 10 ms made
# every request with under ~10 ms left dispatch at once, and under overload, when most
# requests arrive that close to their deadlines, batches shrank, the CPU they wasted
# lengthened the queue, and goodput collapsed to half a deadline-blind batcher's
# (docs/benchmarks.md). 3 ms (the benchmarked value) proved too little: asyncio timers here
# fire 1-2 ms late (epoll waits in whole milliseconds), so a batch left ~1 ms before its
# deadline and a cold forward pass missed it (tests/model, test_forming_batch_leaves_early).
DISPATCH_SLACK_S = 0.005
DISPATCH_SLACK_SHARE = 0.5

# Adaptive dispatch (docs/benchmarks.md has the measurements behind these numbers).
# Overlap: the share of arrivals that came sooner after the previous one than a batch of one
# takes to run (EWMA over arrivals). It reads the arrival process only, so the policy cannot
# feed it: a closed loop of one caller scores 0 (its next request waits for our answer, and
# that answer took at least a batch of one), independent callers at ~1,000 req/s on the demo
# MLP score ~0.4. Below OVERLAP_OFF a batch leaves at once; above OVERLAP_ON it waits for
# company like Triton: a forward pass costs about the same for 1 row as for 8, so serving
# overlapping requests one by one burns the CPU that request handling needs. The band
# between the two keeps noise from flipping the mode.
OVERLAP_ALPHA = 0.02
OVERLAP_ON = 0.2
OVERLAP_OFF = 0.1
SOLO_ALPHA = 0.05  # EWMA weight of each new batch-of-one timing

# Histogram bounds (Prometheus `le`) for the metrics endpoint.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip

T = TypeVar("T")


class BatchRunner(Protocol):
    """What the batcher runs: rows in, one output row per input row out (worker thread)."""

    def run(self, batch: np.ndarray) -> np.ndarray: ...


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False, slots=True)
class _Pending:
    rows: np.ndarray
    n_rows: int
    deadline: float  # time.monotonic() based
    request_id: str
    priority: int
    enqueued: float
    seq: int  # arrival order: ties in deadline are served first come, first served
    future: asyncio.Future[np.ndarray]
    state: _State = _State.QUEUED
    dispatched: float = 0.0
    timer: asyncio.TimerHandle | None = None


def _edf_key(item: _Pending) -> tuple[float, int]:
    return (item.deadline, item.seq)


def _fifo_key(item: _Pending) -> int:
    return item.seq


@dataclass
class Duration:
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


class ArrivalOverlap:
    """Adaptive dispatch's signal: do requests arrive sooner than a batch of one completes?

    `observe(now)` at every arrival folds "this request came less than `solo_s` after the
    previous one" into an EWMA and returns whether batches should wait for company (with
    hysteresis between OVERLAP_ON and OVERLAP_OFF). `solo_s` is the wall time of a batch of
    one, learned from the batches that run (`solo(seconds)`), seeded by the warm-up.
    """

    def __init__(self, solo_s: float = 0.0) -> None:
        self.solo_s = solo_s
        self.share = 0.0
        self.company_expected = False
        self._last = float("-inf")

    def observe(self, now: float) -> bool:
        overlapped = now - self._last < self.solo_s
        self._last = now
        self.share += OVERLAP_ALPHA * (overlapped - self.share)
        threshold = OVERLAP_OFF if self.company_expected else OVERLAP_ON
        self.company_expected = self.share >= threshold
        return self.company_expected

    def solo(self, seconds: float) -> None:
        self.solo_s += (seconds - self.solo_s) * (SOLO_ALPHA if self.solo_s else 1.0)


def _timed_run(runner: BatchRunner, batch: np.ndarray) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    result = runner.run(batch)
    return result, time.perf_counter() - started


class _Worker:
    """One thread that runs the model; each call's result comes back as an asyncio future.

    Leaner than loop.run_in_executor (no concurrent.futures.Future, no chained callbacks):
    one queue put, one call_soon_threadsafe back. The hand-off is paid per batch, and on a
    small model it costs as much as the forward pass itself.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn, args = job
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop closed while the model ran
                return


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Batcher:
    """Queues requests for one model version and runs them in batches (module docstring)."""

    def __init__(
        self,
        runner: BatchRunner,
        batching: BatchingSpec,
        *,
        name: str = "model",
        expected_s: Mapping[int, float] | None = None,
    ) -> None:
        self.runner = runner
        self.batching = batching
        self.name = name
        self.latency = LatencyTable(seed=expected_s)
        self.stats = BatcherStats()
        self._limit = batching.max_batch_size
        self._preferred = sorted(set(batching.preferred_batch_sizes), reverse=True)
        self._max_delay_s = batching.max_queue_delay_ms / 1000.0
        self._adaptive = batching.dispatch == "adaptive"
        self._enforce = batching.deadline_policy == "enforce"
        self._key: Callable[[_Pending], Any] = _edf_key if self._enforce else _fifo_key
        # One list per priority level, sorted by _key; holds queued requests only.
        self._queues: dict[int, list[_Pending]] = {}
        self._waiting = 0  # requests queued
        self._rows = 0  # rows queued
        self._seq = 0
        # The batch loop's plan: None while it waits for any request, else the clock reading
        # at which it will dispatch the forming batch (a submit wakes it only if it changes
        # that plan: the batch filled up, or a deadline needs it to leave sooner).
        self._planned_at: float | None = None
        # Adaptive dispatch: whether arrivals overlap (then batches wait for company).
        self.overlap = ArrivalOverlap()
        self._wakeup = asyncio.Event()
        self._worker = _Worker(f"infer-{name}")
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # --- public API ------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests queued (under deadline_policy "ignore", also those whose caller left)."""
        return self._waiting

    async def submit(
        self, rows: np.ndarray, deadline: float, request_id: str, priority: int = 0
    ) -> np.ndarray:
        """The model's output rows for `rows`, computed in some batch before `deadline`.

        Raises QueueFull (RESOURCE_EXHAUSTED) at once when the queue is at its bound,
        DeadlineMissed (DEADLINE_EXCEEDED) when the deadline passes or cannot be met,
        InferenceFailed (INTERNAL) when the model raised on these rows, Unavailable when
        the batcher is closing. Cancelling the caller withdraws the request.
        """
        if self._closing:
            self.stats.outcomes["closed"] += 1
            raise Unavailable(f"{self.name} is closing")
        if self._waiting >= self.batching.max_queue_size:
            self.stats.outcomes["shed"] += 1
            self.stats.fail.add(0.0)
            log.warning(
                "shed request: queue full",
                extra={"model": self.name, "request_id": request_id, "waiting": self._waiting},
            )
            raise QueueFull(f"queue full ({self._waiting} waiting)")
        now = time.monotonic()
        n_rows = int(rows.shape[0])
        if self._adaptive:
            self.overlap.observe(now)
        if self._enforce:
            expected = self.latency.expected(n_rows)
            remaining = deadline - now
            if remaining < expected:
                self.stats.outcomes["refused"] += 1
                self.stats.fail.add(0.0)
                log.info(
                    "dropped: deadline cannot be met",
                    extra={
                        "model": self.name,
                        "request_id": request_id,
                        "expected_ms": round(expected * 1000, 3),
                        "remaining_ms": round(remaining * 1000, 3),
                    },
                )
                raise DeadlineMissed(
                    f"deadline cannot be met: {max(remaining, 0) * 1000:.1f} ms left, "
                    f"inference takes ~{expected * 1000:.1f} ms"
                )
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name=f"batcher-{self.name}"
            )
        loop = asyncio.get_running_loop()
        self._seq += 1
        item = _Pending(
            rows=rows,
            n_rows=n_rows,
            deadline=deadline,
            request_id=request_id,
            priority=priority,
            enqueued=now,
            seq=self._seq,
            future=loop.create_future(),
        )
        level = self._queues.get(priority)
        if level is None:
            self._queues[priority] = [item]
        elif self._enforce and level[-1].deadline > deadline:
            bisect.insort(level, item, key=_edf_key)
        else:
            level.append(item)
        self._waiting += 1
        self._rows += n_rows
        if self._enforce:
            item.timer = loop.call_at(deadline, self._on_deadline, item)
        if self._should_wake(item):
            self._wakeup.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            self._withdraw(item)
            raise

    async def warm_up(self, sizes: Iterable[int]) -> dict[int, float]:
        """Run the runner's warm-up in the worker thread; seeds and returns expected times.

        In the worker thread itself, because a thread's first forward pass pays for its
        own set-up (intra-op pools, allocator caches): warmed elsewhere, the first real
        batch would still be slow and miss a tight deadline the warm-up timings promised.
        """
        warm_up = getattr(self.runner, "warm_up", None)
        if warm_up is None:
            raise TypeError(f"{type(self.runner).__name__} has no warm_up(sizes)")
        timings: dict[int, float] = await self._worker.call(warm_up, list(sizes))
        for size, seconds in timings.items():
            self.latency.seed(size, seconds)
        if not self.overlap.solo_s and 1 in timings:
            self.overlap.solo(timings[1])
        return timings

    async def close(self) -> None:
        """Refuse new requests, run everything already queued or in flight, then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.shield(self._task)
        self._worker.stop()

    # --- queue bookkeeping -------------------------------------------------------------

    def _should_wake(self, item: _Pending) -> bool:
        """Whether a new request changes what the waiting batch loop would do."""
        planned = self._planned_at
        if planned is None or self._preferred or self._rows >= self._limit:
            return True
        if self._enforce:
            return self._leave_by(item.deadline, item.n_rows) < planned
        return False

    def _leave_by(self, deadline: float, rows: int) -> float:
        """The latest dispatch that still meets `deadline` for a batch of `rows`."""
        expected = self.latency.expected(rows)
        return deadline - expected * (1 + DISPATCH_SLACK_SHARE) - DISPATCH_SLACK_S

    def _leave_queue(self, item: _Pending) -> None:
        """Take a queued request out of the queue for good (expired or cancelled)."""
        self._retire(item)
        level = self._queues.get(item.priority)
        if level is not None:
            at = bisect.bisect_left(level, self._key(item), key=self._key)
            if at < len(level) and level[at] is item:
                del level[at]
                if not level:
                    del self._queues[item.priority]
        self._waiting -= 1
        self._rows -= item.n_rows
        # Recompute the wait: the forming batch may have lost its earliest deadline.
        self._wakeup.set()

    def _withdraw(self, item: _Pending) -> None:
        self.stats.outcomes["cancelled"] += 1
        if item.state is _State.QUEUED and self._enforce:
            self._leave_queue(item)
            log.info(
                "dropped cancelled request",
                extra={
                    "model": self.name,
                    "request_id": item.request_id,
                    "queue_wait_ms": round((time.monotonic() - item.enqueued) * 1000, 3),
                },
            )

    def _retire(self, item: _Pending) -> None:
        item.state = _State.DONE
        if item.timer is not None:
            item.timer.cancel()

    def _on_deadline(self, item: _Pending) -> None:
        if item.future.done():
            return
        now = time.monotonic()
        if item.state is _State.QUEUED:
            self._expire(item, now)
        else:
            # Already in the model: the answer would arrive too late to matter.
            self.stats.outcomes["late"] += 1
            self.stats.fail.add(now - item.enqueued)
            item.future.set_exception(DeadlineMissed("deadline exceeded during inference"))

    def _expire(self, item: _Pending, now: float) -> None:
        """Answer a request whose deadline passed in the queue (already out of it, or not)."""
        if item.state is _State.QUEUED:
            self._leave_queue(item)
        self._retire(item)
        self.stats.outcomes["expired"] += 1
        queue_wait = now - item.enqueued
        self.stats.fail.add(queue_wait)
        log.info(
            "dropped expired request",
            extra={
                "model": self.name,
                "request_id": item.request_id,
                "late_ms": round((now - item.deadline) * 1000, 3),
                "queue_wait_ms": round(queue_wait * 1000, 3),
            },
        )
        if not item.future.done():
            item.future.set_exception(
                DeadlineMissed(f"deadline exceeded after {queue_wait * 1000:.1f} ms in queue")
            )

    def _refuse_unmeetable(self, item: _Pending, now: float, expected: float) -> None:
        self._retire(item)
        self.stats.outcomes["refused"] += 1
        self.stats.fail.add(now - item.enqueued)
        remaining = item.deadline - now
        log.info(
            "dropped: deadline cannot be met",
            extra={
                "model": self.name,
                "request_id": item.request_id,
                "expected_ms": round(expected * 1000, 3),
                "remaining_ms": round(remaining * 1000, 3),
                "queue_wait_ms": round((now - item.enqueued) * 1000, 3),
            },
        )
        if not item.future.done():
            item.future.set_exception(
                DeadlineMissed(
                    f"deadline cannot be met: {remaining * 1000:.1f} ms left, "
                    f"inference takes ~{expected * 1000:.1f} ms"
                )
            )

    # --- batch formation ---------------------------------------------------------------

    def _candidate(self) -> tuple[list[_Pending], bool]:
        """The requests the next batch would take now, and whether it can no longer grow.

        Always a prefix of each priority level's queue, levels in order.
        """
        chosen: list[_Pending] = []
        rows = 0
        limit = self._limit
        for priority in sorted(self._queues):
            for item in self._queues[priority]:
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

    def _preferred_prefix(self, chosen: list[_Pending]) -> list[_Pending] | None:
        """The longest prefix whose rows make a preferred batch size (Triton's rule)."""
        if not self._preferred:
            return None
        best: list[_Pending] | None = None
        rows = 0
        for index, item in enumerate(chosen):
            rows += item.n_rows
            if rows in self._preferred:
                best = chosen[: index + 1]
        return best

    def _dispatch_at(self, chosen: list[_Pending]) -> float:
        """When a forming batch that is neither full nor preferred must leave (<= now: now)."""
        if self._closing or (self._adaptive and not self.overlap.company_expected):
            return float("-inf")
        leave = min(item.enqueued for item in chosen) + self._max_delay_s
        if self._enforce:
            rows = sum(item.n_rows for item in chosen)
            leave = min(leave, self._leave_by(min(item.deadline for item in chosen), rows))
        return leave

    async def _next_batch(self) -> list[_Pending]:
        """Wait for the next batch to form and take it off the queue; [] once closed and empty."""
        loop = asyncio.get_running_loop()
        while True:
            chosen, full = self._candidate()
            if not chosen:
                if self._closing:
                    return []
                self._planned_at = None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            now = time.monotonic()
            preferred = self._preferred_prefix(chosen)
            if preferred is not None:
                chosen = preferred
            elif not full:
                leave = self._dispatch_at(chosen)
                if leave > now:
                    self._planned_at = leave
                    self._wakeup.clear()
                    timer = loop.call_at(leave, self._wakeup.set)
                    try:
                        await self._wakeup.wait()
                    finally:
                        timer.cancel()
                    continue
            self._planned_at = float("-inf")  # dispatching: no submit needs to wake us
            taken = self._take(chosen, now)
            if taken:
                return taken

    def _take(self, chosen: list[_Pending], now: float) -> list[_Pending]:
        """Take `chosen` off the queue; under "enforce", drop what can no longer make it."""
        per_level = collections.Counter(item.priority for item in chosen)
        for priority, count in per_level.items():
            level = self._queues[priority]
            del level[:count]
            if not level:
                del self._queues[priority]
        self._waiting -= len(chosen)
        self._rows -= sum(item.n_rows for item in chosen)
        taken: list[_Pending] = []
        expected = self.latency.expected(sum(item.n_rows for item in chosen))
        for item in chosen:
            item.state = _State.RUNNING  # off the queue either way
            if self._enforce:
                # Timers fire late on a busy loop: check again at the door.
                if item.deadline <= now:
                    self._expire(item, now)
                    continue
                if item.deadline - now < expected:
                    self._refuse_unmeetable(item, now, expected)
                    continue
            elif item.deadline <= now:
                self.stats.expired_computed += 1
            item.dispatched = now
            self.stats.queue_wait_hist.observe(now - item.enqueued)
            taken.append(item)
        return taken

    # --- execution ---------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                batch = await self._next_batch()
            except Exception:  # a bug here must not leave every future caller hanging
                log.exception("batch formation failed", extra={"model": self.name})
                await asyncio.sleep(0.01)
                continue
            if not batch:
                return
            try:
                await self._run_group(batch)
            except Exception as exc:
                log.exception("batch execution failed", extra={"model": self.name})
                for item in batch:
                    self._fail(item, exc)

    async def _run_group(self, items: list[_Pending]) -> None:
        if self._enforce:
            # Requests that expired or were cancelled while an earlier half ran are not
            # retried. (A deadline-blind batcher computes them anyway.)
            items = [item for item in items if not item.future.done()]
            if not items:
                return
        started = time.perf_counter()
        batch = items[0].rows if len(items) == 1 else np.concatenate([i.rows for i in items])
        input_s = time.perf_counter() - started
        size = int(batch.shape[0])
        self.stats.executions += 1
        self.stats.batch_size_hist.observe(size)
        try:
            result, infer_s = await self._worker.call(_timed_run, self.runner, batch)
            if not isinstance(result, np.ndarray) or result.ndim < 1 or result.shape[0] != size:
                got = result.shape[0] if isinstance(result, np.ndarray) and result.ndim else "no"
                raise ValueError(f"model returned {got} rows for a batch of {size}")
        except Exception as exc:
            if len(items) == 1:
                self._fail(items[0], exc)
                return
            log.warning(
                "batch failed; retrying halves to isolate the culprit",
                extra={
                    "model": self.name,
                    "batch_size": size,
                    "requests": len(items),
                    "error": repr(exc),
                },
            )
            middle = len(items) // 2
            await self._run_group(items[:middle])
            await self._run_group(items[middle:])
            return
        self.latency.observe(size, infer_s)
        self.stats.compute_hist.observe(infer_s)
        if size == 1:
            # Dispatch to answer: hand-off and a cache-cold forward pass included.
            self.overlap.solo(time.monotonic() - items[0].dispatched)
        started = time.perf_counter()
        offset = 0
        answered = 0
        finished = time.monotonic()
        stats = self.stats
        for item in items:
            part = result[offset : offset + item.n_rows]
            offset += item.n_rows
            if item.timer is not None:
                item.timer.cancel()
            item.state = _State.DONE
            if item.future.done():
                continue
            item.future.set_result(part)
            answered += 1
            stats.outcomes["ok"] += 1
            stats.inference_count += item.n_rows
            stats.success.add(finished - item.enqueued)
            stats.queue.add(item.dispatched - item.enqueued)
        output_s = time.perf_counter() - started
        stats.compute_input.add(input_s * answered, answered)
        stats.compute_infer.add(infer_s * answered, answered)
        stats.compute_output.add(output_s * answered, answered)
        per_size = stats.for_size(size)
        per_size.executions += 1
        per_size.compute_input.add(input_s)
        per_size.compute_infer.add(infer_s)
        per_size.compute_output.add(output_s)
        stats.last_inference_ms = int(time.time() * 1000)

    def _fail(self, item: _Pending, exc: BaseException) -> None:
        if item.timer is not None:
            item.timer.cancel()
        item.state = _State.DONE
        if item.future.done():
            return
        self.stats.outcomes["failed"] += 1
        self.stats.fail.add(time.monotonic() - item.enqueued)
        log.error(
            "inference failed",
            extra={"model": self.name, "request_id": item.request_id, "rows": item.n_rows},
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        item.future.set_exception(InferenceFailed(f"inference failed ({type(exc).__name__})"))
