"""The batcher: admission, the dispatch policy, and running batches with failure isolation.

- `enqueue` decides at once, without waiting: a full queue sheds (RESOURCE_EXHAUSTED), and
  a request whose remaining time is below the expected time of the smallest batch that can
  hold it is refused (DEADLINE_EXCEEDED) instead of wasting the model on it. `submit` is
  `enqueue` and then the wait for the answer.
- Expired and cancelled requests never reach the model: a timer fails each request at its
  deadline while it waits and takes it out of the queue, and the door checks again.
- Priority levels are strict; within a level, earliest deadline first (`queues`).
- When a batch leaves (`dispatch`): a full batch, or one of the largest preferred size that
  can be formed, leaves at once, as in Triton. Otherwise "fixed_window" waits up to
  `max_queue_delay_ms` after the batch's first request; "adaptive" leaves at once while
  requests do not overlap (`overlap`) and waits like fixed_window once they do. Either way
  a batch leaves earlier when waiting longer would make its earliest deadline unreachable.
- The model runs in one dedicated worker thread (`worker`), off the event loop. While it
  runs, new requests queue up and their delay clocks keep running, so the next batch is
  ready the moment the worker is free.
- A batch that raises is split in halves and retried recursively, so only the culprit
  request(s) fail (INTERNAL, short message; the traceback goes to the log). Every request
  gets exactly one answer.
- `deadline_policy: ignore` turns all deadline handling off (FIFO, no expiry, cancelled
  requests still computed): the behaviour of a deadline-blind batcher, kept so that a
  benchmark can compare the two on the same server. `stats.expired_computed` counts the
  requests that reached the model after their deadline (always 0 under "enforce").
- Every reading of time and every timer goes through the batcher's `clock` (`clock`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar

import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Status, StatusCode

from servemesh.contract.inflight import Call, JournalSlot, NoSlot
from servemesh.contract.wire import Span as SpanAttr
from servemesh.services.model.batching.clock import MONOTONIC, Clock
from servemesh.services.model.batching.overlap import ArrivalOverlap
from servemesh.services.model.batching.queues import Pending, RequestQueue, State
from servemesh.services.model.batching.rows import NamedRows, Rows, cut_rows, join_rows, row_count
from servemesh.services.model.batching.stats import BatcherStats
from servemesh.services.model.batching.worker import Worker
from servemesh.services.model.errors import DeadlineMissed, InferenceFailed, QueueFull, Unavailable
from servemesh.services.model.latency import LatencyTable
from servemesh.services.runtime.tracing import tracer
from servemesh.spec import BatchingSpec

log = logging.getLogger(__name__)

T = TypeVar("T")

# A batch leaves this much before the latest moment that still meets its earliest deadline
# (plus a share of its expected time, for forward passes slowed by cold caches), to cover
# event loop timers that fire a millisecond or two late on a busy box. Sending the answer
# is already covered by the servicer's hop budget. A wider margin is not safer: 10 ms made
# every request with under ~10 ms left dispatch at once, and under overload, when most
# requests arrive that close to their deadlines, batches shrank, the CPU they wasted
# lengthened the queue, and goodput collapsed to half a deadline-blind batcher's
# (docs/benchmarks.md). 3 ms (the benchmarked value) proved too little: asyncio timers here
# fire 1-2 ms late (epoll waits in whole milliseconds), so a batch left ~1 ms before its
# deadline and a cold forward pass missed it.
DISPATCH_SLACK_S = 0.005
DISPATCH_SLACK_SHARE = 0.5


class BatchRunner(Protocol):
    """What the batcher runs: rows in, one output row per input row out (worker thread).

    Rows are one array for a one-tensor model, NamedRows for a multi-tensor one (`rows`).
    """

    def run(self, batch: Rows) -> Rows: ...


def _timed_run(clock: Clock, runner: BatchRunner, batch: Rows) -> tuple[Rows, float]:
    started = clock.now()
    result = runner.run(batch)
    return result, clock.now() - started


def payload_sha256(rows: Rows) -> str:
    """The sha256 of a request's input payload as the model receives it: each input
    tensor's bytes (C order, the signature's dtype), tensors in the signature's order. For
    a raw OIP request of the signature's dtypes, the sha256 of its raw_input_contents one
    after another."""
    if isinstance(rows, NamedRows):
        digest = hashlib.sha256()
        for tensor in rows.values():
            digest.update(_contiguous(tensor))
        return digest.hexdigest()
    return hashlib.sha256(_contiguous(rows)).hexdigest()


def _contiguous(array: np.ndarray) -> memoryview:
    # A decoded request is contiguous already: no copy in the common case.
    return (array if array.flags.c_contiguous else np.ascontiguousarray(array)).data


def _journaled_run(
    clock: Clock, runner: BatchRunner, batch: Rows, slot: JournalSlot | NoSlot, items: list[Pending]
) -> tuple[Rows, float]:
    """`_timed_run` with the batch's calls in the in-flight journal while the model runs
    (servemesh.contract.inflight): a crash of the process in the forward pass names them. In the
    model's thread, so the event loop pays nothing for it."""
    calls: list[Call] = [
        (item.request_id, item.caller, payload_sha256(item.rows)) for item in items
    ]
    slot.begin(calls)
    try:
        return _timed_run(clock, runner, batch)
    finally:
        slot.end()


class Batcher:
    """Queues requests for one model version and runs them in batches (module docstring).

    `expected_s` seeds the seconds per batch size that deadline checks start from, as
    `warm_up` measures them; `clock` is where every decision reads time (tests pass a
    ManualClock).
    """

    def __init__(
        self,
        runner: BatchRunner,
        batching: BatchingSpec,
        *,
        name: str = "model",
        expected_s: Mapping[int, float] | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.runner = runner
        self.batching = batching
        self.name = name
        self.clock = clock
        self.latency = LatencyTable(seed=expected_s)
        self.stats = BatcherStats()
        self._limit = batching.max_batch_size
        self._preferred = sorted(set(batching.preferred_batch_sizes), reverse=True)
        self._max_delay_s = batching.max_queue_delay_ms / 1000.0
        self._adaptive = batching.dispatch == "adaptive"
        self._enforce = batching.deadline_policy == "enforce"
        self._queue = RequestQueue(by_deadline=self._enforce)
        # The batch loop's plan: None while it waits for any request, else the clock reading
        # at which it will dispatch the forming batch (a submit wakes it only if it changes
        # that plan: the batch filled up, or a deadline needs it to leave sooner).
        self._planned_at: float | None = None
        # Adaptive dispatch: whether arrivals overlap (then batches wait for company).
        self.overlap = ArrivalOverlap()
        if expected_s and 1 in expected_s:
            self.overlap.solo(expected_s[1])
        self._wakeup = asyncio.Event()
        self._worker = Worker(f"infer-{name}", nice=batching.inference_nice)
        # The model thread's slot in the server's in-flight journal (servemesh.contract.inflight),
        # given by the server once the version is served; None: batches are not journaled.
        self.journal: JournalSlot | NoSlot | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # --- public API ------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests queued (under deadline_policy "ignore", also those whose caller left)."""
        return self._queue.waiting

    def enqueue(
        self, rows: Rows, deadline: float, request_id: str, priority: int = 0, caller: str = ""
    ) -> asyncio.Future[Rows]:
        """Admit a request or refuse it at once; the future resolves to its output rows.

        Admission never waits (this is not a coroutine). Raises QueueFull
        (RESOURCE_EXHAUSTED) when the queue is at its bound, DeadlineMissed
        (DEADLINE_EXCEEDED) when the deadline cannot be met, Unavailable when the batcher
        is closing. The future fails with DeadlineMissed when the deadline passes first,
        InferenceFailed (INTERNAL) when the model raised on these rows. Cancelling the
        future (as cancelling a caller that awaits it does) withdraws the request.
        """
        if self._closing:
            self.stats.outcomes["closed"] += 1
            raise Unavailable(f"{self.name} is closing")
        waiting = self._queue.waiting
        if waiting >= self.batching.max_queue_size:
            self.stats.outcomes["shed"] += 1
            self.stats.fail.add(0.0)
            log.warning(
                "shed request: queue full",
                extra={"model": self.name, "request_id": request_id, "waiting": waiting},
            )
            raise QueueFull(f"queue full ({waiting} waiting)")
        now = self.clock.now()
        n_rows = row_count(rows)
        if self._adaptive:
            self.overlap.observe(now)
        if self._enforce:
            expected = self.latency.expected(n_rows)
            if deadline - now < expected:
                raise self._refuse_unmeetable(request_id, deadline, expected, now, enqueued=now)
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._loop(), name=f"batcher-{self.name}")
        item = Pending(
            rows=rows,
            n_rows=n_rows,
            deadline=deadline,
            request_id=request_id,
            priority=priority,
            enqueued=now,
            caller=caller,
            future=loop.create_future(),
            span=trace.get_current_span(),
        )
        self._queue.push(item)
        if self._enforce:
            item.timer = self.clock.call_at(deadline, self._on_deadline, item)
        item.future.add_done_callback(functools.partial(self._on_answered, item))
        if self._should_wake(item):
            self._wakeup.set()
        return item.future

    async def submit(
        self, rows: Rows, deadline: float, request_id: str, priority: int = 0, caller: str = ""
    ) -> Rows:
        """The model's output rows for `rows`, computed in some batch before `deadline`.

        `enqueue` and its answer; raises what either raises. Cancelling the caller
        withdraws the request. `caller` is who sent it, as the in-flight journal names it.
        """
        return await self.enqueue(rows, deadline, request_id, priority, caller)

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

    @property
    def closing(self) -> bool:
        """Whether `close` has begun (new requests are refused)."""
        return self._closing

    def run_in_worker(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """`fn()` in the thread that runs this batcher's batches, after the calls handed to
        it already: the model server's readiness check goes this way, so a model whose
        thread hangs or crashes fails the check as its requests would. Not to be called
        once `close` has begun (the thread stops after what it holds)."""
        return self._worker.call(fn)

    def busy_for(self) -> float:
        """Seconds the model's thread has spent on its current call; 0.0 while idle."""
        return self._worker.busy_for()

    async def close(self) -> None:
        """Refuse new requests, run everything already queued or in flight, then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.shield(self._task)
        self._worker.stop()

    # --- queue bookkeeping -------------------------------------------------------------

    def _should_wake(self, item: Pending) -> bool:
        """Whether a new request changes what the waiting batch loop would do."""
        planned = self._planned_at
        if planned is None or self._preferred or self._queue.rows >= self._limit:
            return True
        if self._enforce:
            return self._leave_by(item.deadline, item.n_rows) < planned
        return False

    def _leave_by(self, deadline: float, rows: int) -> float:
        """The latest dispatch that still meets `deadline` for a batch of `rows`."""
        expected = self.latency.expected(rows)
        return deadline - expected * (1 + DISPATCH_SLACK_SHARE) - DISPATCH_SLACK_S

    def _leave_queue(self, item: Pending) -> None:
        """Take a queued request out of the queue for good (expired or cancelled)."""
        self._retire(item)
        self._queue.remove(item)
        # Recompute the wait: the forming batch may have lost its earliest deadline.
        self._wakeup.set()

    def _on_answered(self, item: Pending, future: asyncio.Future[Rows]) -> None:
        if future.cancelled():
            self._withdraw(item)

    def _withdraw(self, item: Pending) -> None:
        self.stats.outcomes["cancelled"] += 1
        if item.state is State.QUEUED and self._enforce:
            self._leave_queue(item)
            log.info(
                "dropped cancelled request",
                extra={
                    "model": self.name,
                    "request_id": item.request_id,
                    "queue_wait_ms": round((self.clock.now() - item.enqueued) * 1000, 3),
                },
            )

    def _retire(self, item: Pending) -> None:
        item.state = State.DONE
        if item.timer is not None:
            item.timer.cancel()

    def _on_deadline(self, item: Pending) -> None:
        if item.future.done():
            return
        now = self.clock.now()
        if item.state is State.QUEUED:
            self._expire(item, now)
        else:
            # Already in the model: the answer would arrive too late to matter.
            self.stats.outcomes["late"] += 1
            self.stats.fail.add(now - item.enqueued)
            log.info(
                "answer late: deadline passed during inference",
                extra={"model": self.name, "request_id": item.request_id},
            )
            item.future.set_exception(DeadlineMissed("deadline exceeded during inference"))

    def _expire(self, item: Pending, now: float) -> None:
        """Answer a request whose deadline passed in the queue (already out of it, or not)."""
        if item.state is State.QUEUED:
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

    def _refuse_unmeetable(
        self, request_id: str, deadline: float, expected: float, now: float, *, enqueued: float
    ) -> DeadlineMissed:
        """Count and log a request that cannot finish by its deadline; the error it gets.

        The one refusal for both places that check: admission and the door of its batch.
        """
        remaining = deadline - now
        self.stats.outcomes["refused"] += 1
        self.stats.fail.add(now - enqueued)
        log.info(
            "dropped: deadline cannot be met",
            extra={
                "model": self.name,
                "request_id": request_id,
                "expected_ms": round(expected * 1000, 3),
                "remaining_ms": round(remaining * 1000, 3),
                "queue_wait_ms": round((now - enqueued) * 1000, 3),
            },
        )
        return DeadlineMissed(
            f"deadline cannot be met: {max(remaining, 0) * 1000:.1f} ms left, "
            f"inference takes ~{expected * 1000:.1f} ms"
        )

    # --- batch formation ---------------------------------------------------------------

    def _preferred_prefix(self, chosen: list[Pending]) -> list[Pending] | None:
        """The longest prefix whose rows make a preferred batch size (Triton's rule)."""
        if not self._preferred:
            return None
        best: list[Pending] | None = None
        rows = 0
        for index, item in enumerate(chosen):
            rows += item.n_rows
            if rows in self._preferred:
                best = chosen[: index + 1]
        return best

    def _dispatch_at(self, chosen: list[Pending]) -> float:
        """When a forming batch that is neither full nor preferred must leave (<= now: now)."""
        if self._closing or (self._adaptive and not self.overlap.company_expected):
            return float("-inf")
        leave = min(item.enqueued for item in chosen) + self._max_delay_s
        if self._enforce:
            rows = sum(item.n_rows for item in chosen)
            leave = min(leave, self._leave_by(min(item.deadline for item in chosen), rows))
        return leave

    async def _next_batch(self) -> list[Pending]:
        """Wait for the next batch to form and take it off the queue; [] once closed and empty."""
        while True:
            chosen, full = self._queue.candidate(self._limit)
            if not chosen:
                if self._closing:
                    return []
                self._planned_at = None
                self._wakeup.clear()
                await self.clock.wait(self._wakeup)
                continue
            now = self.clock.now()
            preferred = self._preferred_prefix(chosen)
            if preferred is not None:
                chosen = preferred
            elif not full:
                leave = self._dispatch_at(chosen)
                if leave > now:
                    self._planned_at = leave
                    self._wakeup.clear()
                    await self.clock.wait(self._wakeup, until=leave)
                    continue
            self._planned_at = float("-inf")  # dispatching: no submit needs to wake us
            taken = self._take(chosen, now)
            if taken:
                return taken

    def _take(self, chosen: list[Pending], now: float) -> list[Pending]:
        """Take `chosen` off the queue; under "enforce", drop what can no longer make it."""
        self._queue.take(chosen)
        taken: list[Pending] = []
        expected = self.latency.expected(sum(item.n_rows for item in chosen))
        for item in chosen:
            item.state = State.RUNNING  # off the queue either way
            if self._enforce:
                # Timers fire late on a busy loop: check again at the door.
                if item.deadline <= now:
                    self._expire(item, now)
                    continue
                if item.deadline - now < expected:
                    self._retire(item)
                    error = self._refuse_unmeetable(
                        item.request_id, item.deadline, expected, now, enqueued=item.enqueued
                    )
                    if not item.future.done():
                        item.future.set_exception(error)
                    continue
            elif item.deadline <= now:
                self.stats.expired_computed += 1
            item.dispatched = now
            self.stats.queue_wait_hist.observe(now - item.enqueued)
            if item.span.is_recording():
                item.span.set_attribute(SpanAttr.QUEUE_WAIT_MS, (now - item.enqueued) * 1000)
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

    async def _run_group(self, items: list[Pending]) -> None:
        if self._enforce:
            # Requests that expired or were cancelled while an earlier half ran are not
            # retried. (A deadline-blind batcher computes them anyway.)
            items = [item for item in items if not item.future.done()]
            if not items:
                return
        clock = self.clock
        started = clock.now()
        batch = join_rows([item.rows for item in items])
        input_s = clock.now() - started
        size = row_count(batch)
        self.stats.executions += 1
        self.stats.batch_size_hist.observe(size)
        span = self._batch_span(items, size)
        try:
            if self.journal is None:
                result, infer_s = await self._worker.call(_timed_run, clock, self.runner, batch)
            else:
                result, infer_s = await self._worker.call(
                    _journaled_run, clock, self.runner, batch, self.journal, items
                )
            kind = NamedRows if isinstance(batch, NamedRows) else np.ndarray
            if not isinstance(result, kind) or row_count(result) != size:
                got = row_count(result) if isinstance(result, kind) else "no"
                raise ValueError(f"model returned {got} rows for a batch of {size}")
            if span is not None:
                span.set_attribute(SpanAttr.FORWARD_MS, infer_s * 1000)
                span.end()
        except Exception as exc:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.end()
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
        finished = clock.now()
        if size == 1:
            # Dispatch to answer: hand-off and a cache-cold forward pass included.
            self.overlap.solo(finished - items[0].dispatched)
        offset = 0
        answered = 0
        stats = self.stats
        for item in items:
            part = cut_rows(result, offset, offset + item.n_rows)
            offset += item.n_rows
            if item.timer is not None:
                item.timer.cancel()
            item.state = State.DONE
            if item.future.done():
                continue
            item.future.set_result(part)
            answered += 1
            stats.outcomes["ok"] += 1
            stats.inference_count += item.n_rows
            stats.success.add(finished - item.enqueued)
            stats.queue.add(item.dispatched - item.enqueued)
        stats.record_batch(
            size, answered, input_s=input_s, infer_s=infer_s, output_s=clock.now() - finished
        )

    def _batch_span(self, items: list[Pending], size: int) -> trace.Span | None:
        """The span of one batch, when a request in it is traced: a trace of its own (it
        serves many), linked to the span of every request it serves."""
        contexts = [item.span.get_span_context() for item in items]
        if not any(ctx.trace_flags.sampled for ctx in contexts):
            return None
        waits = [(item.dispatched - item.enqueued) * 1000 for item in items]
        return tracer().start_span(
            "batch",
            context=Context(),  # a new trace, not the first request's (the loop's context)
            links=[Link(ctx) for ctx in contexts if ctx.is_valid],
            attributes={
                SpanAttr.BATCHER: self.name,
                SpanAttr.BATCH_SIZE: size,
                SpanAttr.BATCH_REQUESTS: len(items),
                SpanAttr.QUEUE_WAIT_MS: max(waits),
                SpanAttr.QUEUE_WAIT_MEAN_MS: sum(waits) / len(waits),
            },
        )

    def _fail(self, item: Pending, exc: BaseException) -> None:
        if item.timer is not None:
            item.timer.cancel()
        item.state = State.DONE
        if item.future.done():
            return
        self.stats.outcomes["failed"] += 1
        self.stats.fail.add(self.clock.now() - item.enqueued)
        log.error(
            "inference failed",
            extra={"model": self.name, "request_id": item.request_id, "rows": item.n_rows},
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        item.future.set_exception(InferenceFailed(f"inference failed ({type(exc).__name__})"))
