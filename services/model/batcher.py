"""A deadline-aware dynamic batcher for one loaded (model, version).

Modelled on Ray Serve's batcher - a small record per queued request, one loop that forms
batches and recomputes how long it may still wait, every waiter of a failed batch told -
with what Ray lacks: deadlines, priorities, load shedding and failure isolation.

- `submit` never blocks: a full queue sheds at once with RESOURCE_EXHAUSTED.
- A request whose remaining time is below the expected time of the smallest batch that can
  hold it is refused at once with DEADLINE_EXCEEDED instead of wasting the model on it.
- Expired and cancelled requests never reach the model: a timer fails each request at its
  deadline while it waits, and batch formation skips whatever is no longer wanted.
- The first request of a batch waits at most `max_queue_delay_ms` for company, and only when
  no full (or preferred-size) batch can be formed, as in Triton; a batch leaves earlier when
  waiting longer would make its earliest deadline unreachable.
- Lower priority values are served first (0 before 1); FIFO within a priority.
- The model runs in one worker thread, off the event loop. While it runs, new requests
  queue up and their delay clocks keep running, so the next batch is ready the moment the
  worker is free.
- A batch that raises is split in halves and retried recursively, so only the culprit
  request(s) fail (INTERNAL, short message; the traceback goes to the log).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from servemesh.services.model.errors import DeadlineMissed, InferenceFailed, QueueFull, Unavailable
from servemesh.services.model.latency import LatencyTable
from servemesh.spec import BatchingSpec

log = logging.getLogger(__name__)

# A batch leaves this much before the latest moment that still meets its earliest deadline
# (plus a share of its expected time). Event loop timers fire a millisecond or two late on
# a busy box, and a forward pass after an idle spell runs several times slower than the
# warm average (cold caches: the demo MLP is ~1 MB of weights), so a batch that left
# exactly on time would miss. Leaving early only costs batch size.
DISPATCH_SLACK_S = 0.010
DISPATCH_SLACK_SHARE = 0.5


class BatchRunner(Protocol):
    """What the batcher runs: rows in, one output row per input row out (worker thread)."""

    def run(self, batch: np.ndarray) -> np.ndarray: ...


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class _Pending:
    rows: np.ndarray
    deadline: float  # time.monotonic() based
    request_id: str
    priority: int
    enqueued: float
    future: asyncio.Future[np.ndarray]
    state: _State = _State.QUEUED
    dispatched: float = 0.0
    timer: asyncio.TimerHandle | None = None

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def wanted(self) -> bool:
        return self.state is _State.QUEUED and not self.future.done()


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)


@dataclass
class BatchSizeStats:
    """Model calls of one batch size (Triton's per-batch-size statistics)."""

    executions: int = 0
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class BatcherStats:
    """Counters for tests and for OIP ModelStatistics.

    Triton's convention: `inference_count` counts rows answered, `executions` counts model
    calls (including the extra calls that isolate a failing request), so the mean batch size
    is inference_count / executions. Per-request durations (success, fail, queue, compute_*)
    count requests, each charged the whole time of the batch it rode in; `fail` counts every
    request answered with an error (shed, refused, expired, failed). `outcomes` counts them
    by kind: ok, shed, refused (deadline cannot be met), expired, late (deadline passed during
    inference), cancelled, failed, closed.
    """

    executions: int = 0
    inference_count: int = 0
    last_inference_ms: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batch_sizes: dict[int, BatchSizeStats] = field(default_factory=dict)

    def for_size(self, size: int) -> BatchSizeStats:
        stats = self.batch_sizes.get(size)
        if stats is None:
            stats = self.batch_sizes[size] = BatchSizeStats()
        return stats


def _timed_run(runner: BatchRunner, batch: np.ndarray) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    result = runner.run(batch)
    return result, time.perf_counter() - started


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
        self._preferred = frozenset(batching.preferred_batch_sizes)
        self._max_delay_s = batching.max_queue_delay_ms / 1000.0
        self._queues: dict[int, collections.deque[_Pending]] = {}
        self._waiting = 0  # requests queued and still wanted
        self._records = 0  # records in the queues, wanted or not (dead ones linger until popped)
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"infer-{name}")
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # --- public API ------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests queued and still wanted."""
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
        self._ensure_started()
        loop = asyncio.get_running_loop()
        item = _Pending(
            rows=rows,
            deadline=deadline,
            request_id=request_id,
            priority=priority,
            enqueued=now,
            future=loop.create_future(),
        )
        item.timer = loop.call_later(max(remaining, 0.0), self._on_deadline, item)
        self._queues.setdefault(priority, collections.deque()).append(item)
        self._records += 1
        self._waiting += 1
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
        loop = asyncio.get_running_loop()
        timings: dict[int, float] = await loop.run_in_executor(self._executor, warm_up, list(sizes))
        for size, seconds in timings.items():
            self.latency.seed(size, seconds)
        return timings

    async def close(self) -> None:
        """Refuse new requests, run everything already queued or in flight, then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.shield(self._task)
        self._executor.shutdown(wait=False)

    # --- queue bookkeeping -------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name=f"batcher-{self.name}"
            )

    def _leave_queue(self, item: _Pending) -> None:
        """Account for a queued request that will never be dispatched."""
        item.state = _State.DONE
        self._waiting -= 1
        if item.timer is not None:
            item.timer.cancel()
        # Recompute the wait: the forming batch may have lost its earliest deadline.
        self._wakeup.set()

    def _withdraw(self, item: _Pending) -> None:
        self.stats.outcomes["cancelled"] += 1
        if item.state is _State.QUEUED:
            self._leave_queue(item)
            log.info(
                "dropped cancelled request",
                extra={
                    "model": self.name,
                    "request_id": item.request_id,
                    "queue_wait_ms": round((time.monotonic() - item.enqueued) * 1000, 3),
                },
            )

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
        self._leave_queue(item)
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
        self._leave_queue(item)
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
        item.future.set_exception(
            DeadlineMissed(
                f"deadline cannot be met: {remaining * 1000:.1f} ms left, "
                f"inference takes ~{expected * 1000:.1f} ms"
            )
        )

    def _compact(self) -> None:
        # Dead records are normally dropped as they reach the front; when many pile up
        # behind live ones (say, low-priority requests expiring under high-priority load)
        # sweep them so memory stays bounded by the queue size.
        if self._records - self._waiting <= max(64, self._waiting):
            return
        for priority, queue in list(self._queues.items()):
            live = collections.deque(item for item in queue if item.wanted)
            if live:
                self._queues[priority] = live
            else:
                del self._queues[priority]
        self._records = sum(len(queue) for queue in self._queues.values())

    # --- batch formation ---------------------------------------------------------------

    def _candidate(self) -> tuple[list[_Pending], bool]:
        """The requests the next batch would take now, and whether it can no longer grow."""
        chosen: list[_Pending] = []
        rows = 0
        limit = self.batching.max_batch_size
        for priority in sorted(self._queues):
            queue = self._queues[priority]
            while queue and not queue[0].wanted:
                queue.popleft()
                self._records -= 1
            if not queue:
                del self._queues[priority]
                continue
            for item in queue:
                if not item.wanted:
                    continue
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

    def _dispatch_at(self, chosen: list[_Pending], full: bool) -> float:
        """When the forming batch must leave (a clock reading; <= now means now)."""
        rows = sum(item.n_rows for item in chosen)
        if full or self._closing or rows in self._preferred:
            return float("-inf")
        by_delay = min(item.enqueued for item in chosen) + self._max_delay_s
        # Leave while the earliest deadline can still be met by this batch.
        expected = self.latency.expected(rows)
        by_deadline = (
            min(item.deadline for item in chosen)
            - expected * (1 + DISPATCH_SLACK_SHARE)
            - DISPATCH_SLACK_S
        )
        return min(by_delay, by_deadline)

    async def _next_batch(self) -> list[_Pending]:
        """Wait for the next batch to form and take it off the queue; [] once closed and empty."""
        while True:
            self._compact()
            chosen, full = self._candidate()
            if not chosen:
                if self._closing:
                    return []
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            now = time.monotonic()
            wait = self._dispatch_at(chosen, full) - now
            if wait > 0:
                self._wakeup.clear()
                try:
                    async with asyncio.timeout(wait):
                        await self._wakeup.wait()
                except TimeoutError:
                    pass
                continue
            taken: list[_Pending] = []
            for item in chosen:
                queue = self._queues[item.priority]
                queue.remove(item)
                self._records -= 1
                if not queue:
                    del self._queues[item.priority]
                if item.deadline <= now:
                    self._expire(item, now)
                    continue
                expected = self.latency.expected(item.n_rows)
                if item.deadline - now < expected:
                    self._refuse_unmeetable(item, now, expected)
                    continue
                self._waiting -= 1
                item.state = _State.RUNNING
                item.dispatched = now
                taken.append(item)
            if taken:
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
        # Requests that expired or were cancelled while an earlier half ran are not retried.
        items = [item for item in items if not item.future.done()]
        if not items:
            return
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        batch = items[0].rows if len(items) == 1 else np.concatenate([i.rows for i in items])
        input_s = time.perf_counter() - started
        size = int(batch.shape[0])
        try:
            self.stats.executions += 1
            result, infer_s = await loop.run_in_executor(
                self._executor, _timed_run, self.runner, batch
            )
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
        started = time.perf_counter()
        offset = 0
        answered = 0
        finished = time.monotonic()
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
            self.stats.outcomes["ok"] += 1
            self.stats.inference_count += item.n_rows
            self.stats.success.add(finished - item.enqueued)
            self.stats.queue.add(item.dispatched - item.enqueued)
        output_s = time.perf_counter() - started
        self.stats.compute_input.add(input_s * answered, answered)
        self.stats.compute_infer.add(infer_s * answered, answered)
        self.stats.compute_output.add(output_s * answered, answered)
        per_size = self.stats.for_size(size)
        per_size.executions += 1
        per_size.compute_input.add(input_s)
        per_size.compute_infer.add(infer_s)
        per_size.compute_output.add(output_s)
        self.stats.last_inference_ms = int(time.time() * 1000)

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
