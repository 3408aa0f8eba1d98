"""Coalescing: concurrent requests under one key share one downstream call.

The gateway's dynamic batching, one hop before the model server's: a Predict's feature read
and its model call join those of other Predicts that go to the same place, and one call
leaves for all of them. Kept free of network code (the call itself is the `send` it is
given), so its rules are tested with an injected clock and no server.

When a call leaves ("natural batching", no timer):

- nothing under the key is in flight: on the event loop's next turn, with whatever joined
  during this one (a lone caller waits for no company that is not coming: c=1 latency
  does not grow);
- a call under the key is in flight: when it returns, with everything that queued meanwhile;
- the queued rows reach the key's row cap: at once, beside the call in flight.

A call leaves with the earliest deadline of its members. A member whose deadline passes
while it waits is answered DEADLINE_EXCEEDED at that moment and leaves nobody waiting; one
whose caller gave up (cancelled) is left out. `send` must settle every member's future it
is given (a result or an exception); one it leaves unsettled is failed as Internal, so no
caller is left hanging.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from servemesh.services.runtime.errors import DeadlineExceeded, Internal

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)
class Member(Generic[T, R]):
    """One caller's share of a coalesced call."""

    item: T  # what the caller brings (its ids, its rows)
    rows: int
    deadline: float  # on the coalescer's clock
    future: asyncio.Future[R]
    context: contextvars.Context  # the caller's (its span, its request id)
    timer: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> bool:
        return not self.future.done()


@dataclass(eq=False)
class _Queue(Generic[T, R]):
    members: list[Member[T, R]] = field(default_factory=list)
    rows: int = 0
    in_flight: int = 0
    scheduled: bool = False


Send = Callable[[K, list[Member[T, R]]], Awaitable[None]]


class Coalescer(Generic[K, T, R]):
    """Members submitted under one key leave together (see the module docstring).

    `send(key, members)` makes the one call and settles every member's future;
    `on_call(key, members)` is told of each call as it leaves (metrics)."""

    def __init__(
        self,
        send: Send[K, T, R],
        *,
        clock: Callable[[], float] = time.monotonic,
        on_call: Callable[[K, int], None] | None = None,
    ) -> None:
        self._send = send
        self._clock = clock
        self._on_call = on_call
        self._queues: dict[K, _Queue[T, R]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, key: K, item: T, rows: int, deadline: float, max_rows: int) -> R:
        """Join the next call under `key` (at most `max_rows` rows a call; a member with more
        goes alone) and wait for this member's share of its answer."""
        if deadline <= self._clock():
            raise DeadlineExceeded("the caller's deadline passed before the call could leave")
        loop = asyncio.get_running_loop()
        member: Member[T, R] = Member(
            item, rows, deadline, loop.create_future(), contextvars.copy_context()
        )
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue()
        queue.members.append(member)
        queue.rows += rows
        if queue.rows >= max_rows:
            self._leave(key, queue, max_rows)
        elif queue.in_flight:
            # It waits for the call in flight; its own deadline may come first.
            member.timer = loop.call_at(self._loop_time(loop, deadline), self._expire, key, member)
        elif not queue.scheduled:
            queue.scheduled = True
            loop.call_soon(self._leave_scheduled, key, max_rows)
        return await member.future

    async def alone(self, key: K, item: T, rows: int, deadline: float) -> R:
        """Make `key`'s call for this one member now, past the queue and uncounted by
        `on_call`: a call that may not be shared is made by the same `send` as one that is,
        so the two never drift apart. It runs in the caller's task (a cancelled caller
        cancels it)."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        member = Member(item, rows, deadline, future, contextvars.copy_context())
        await self._send(key, [member])
        if member.waiting:
            raise Internal("the call left its member unanswered")
        return member.future.result()

    def pending(self, key: K) -> int:
        """Members waiting under `key` (tests, debugging)."""
        queue = self._queues.get(key)
        return len(queue.members) if queue is not None else 0

    def waiting(self) -> int:
        """Members waiting under any key, for a call in flight or the loop's next turn. Read
        by the metrics endpoint's thread: the values are copied in one step (atomic under
        the GIL) rather than iterated while the event loop may change the dict."""
        return sum(len(queue.members) for queue in list(self._queues.values()))

    def _loop_time(self, loop: asyncio.AbstractEventLoop, deadline: float) -> float:
        return loop.time() + max(0.0, deadline - self._clock())

    def _expire(self, key: K, member: Member[T, R]) -> None:
        member.timer = None
        if member.waiting:
            member.future.set_exception(
                DeadlineExceeded("the caller's deadline passed while its call waited to leave")
            )
        queue = self._queues.get(key)
        if queue is not None and member in queue.members:
            queue.members.remove(member)
            queue.rows -= member.rows
            self._forget_if_idle(key, queue)

    def _forget_if_idle(self, key: K, queue: _Queue[T, R]) -> None:
        if not queue.members and not queue.in_flight and not queue.scheduled:
            if self._queues.get(key) is queue:
                del self._queues[key]

    def _leave_scheduled(self, key: K, max_rows: int) -> None:
        queue = self._queues.get(key)
        if queue is None:
            return
        queue.scheduled = False
        self._leave(key, queue, max_rows)

    def _leave(self, key: K, queue: _Queue[T, R], max_rows: int) -> None:
        """Send what is queued under `key` now, in calls of at most `max_rows` rows."""
        while queue.members:
            batch = self._take(queue, max_rows)
            if batch:
                self._start(key, queue, batch, max_rows)
        self._forget_if_idle(key, queue)

    def _take(self, queue: _Queue[T, R], max_rows: int) -> list[Member[T, R]]:
        now = self._clock()
        batch: list[Member[T, R]] = []
        rows = 0
        while queue.members:
            member = queue.members[0]
            if batch and rows + member.rows > max_rows:
                break
            queue.members.pop(0)
            queue.rows -= member.rows
            if member.timer is not None:
                member.timer.cancel()
                member.timer = None
            if not member.waiting:
                continue  # its caller gave up
            if member.deadline <= now:
                member.future.set_exception(
                    DeadlineExceeded("the caller's deadline passed before its call could leave")
                )
                continue
            batch.append(member)
            rows += member.rows
        return batch

    def _start(self, key: K, queue: _Queue[T, R], batch: list[Member[T, R]], max_rows: int) -> None:
        queue.in_flight += 1
        if self._on_call is not None:
            self._on_call(key, len(batch))
        # In the first member's context: a lone member's call is exactly its own call (its
        # span the parent, its request id in the logs).
        task = asyncio.get_running_loop().create_task(
            self._run(key, queue, batch, max_rows), context=batch[0].context
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self, key: K, queue: _Queue[T, R], batch: list[Member[T, R]], max_rows: int
    ) -> None:
        try:
            await self._send(key, batch)
        except BaseException as exc:  # a bug in send: its members must still hear of it
            for member in batch:
                if member.waiting:
                    member.future.set_exception(Internal(f"coalesced call failed: {exc!r}"))
            if not isinstance(exc, Exception):
                raise
        finally:
            for member in batch:
                if member.waiting:
                    member.future.set_exception(Internal("coalesced call left a member unanswered"))
            queue.in_flight -= 1
            # Whatever queued behind this call leaves now.
            self._leave(key, queue, max_rows)


def settle(member: Member[Any, R], result: R) -> None:
    """Answer a member unless its caller already gave up."""
    if member.waiting:
        member.future.set_result(result)


def fail(member: Member[Any, Any], exc: BaseException) -> None:
    """Fail a member unless its caller already gave up."""
    if member.waiting:
        member.future.set_exception(exc)
