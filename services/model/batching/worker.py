"""The dedicated thread that runs the model: each call's result comes back as an asyncio future."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


class Worker:
    """One thread that runs the calls handed to it, in order, off the event loop.

    Leaner than loop.run_in_executor (no concurrent.futures.Future, no chained callbacks):
    one queue put, one call_soon_threadsafe back. The hand-off is paid per batch, and on a
    small model it costs as much as the forward pass itself.

    `nice` lowers the thread's CPU priority by that much (BatchingSpec.inference_nice).
    """

    def __init__(self, name: str, nice: int = 0) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._nice = nice
        # The thread's nice value (set before __init__ returns; None where it could not be read).
        self.niceness: int | None = None
        # time.monotonic() when the call running now began; None while the thread waits.
        # Written by the thread alone and read by the event loop (one attribute store each
        # way, atomic under the GIL): the model server's liveness asks how long a call has
        # run, so a model stuck in a forward pass shows without joining the thread.
        self.busy_since: float | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` in the worker thread; the future holds its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def busy_for(self) -> float:
        """Seconds the call running now has taken so far; 0.0 while the thread waits."""
        since = self.busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def stop(self) -> None:
        """Let the thread end once the calls already handed to it are done."""
        self._jobs.put(None)

    def _lower_priority(self) -> None:
        """Raise this thread's nice value by `nice` (Linux: a thread is a schedulable task of
        its own; raising it needs no privilege)."""
        tid = threading.get_native_id()
        try:
            if self._nice:
                current = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, min(19, current + self._nice))
            self.niceness = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError as exc:
            log.warning("inference thread keeps the server's priority: %s", exc)

    def _serve(self) -> None:
        self._lower_priority()
        self._started.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn, args = job
            self.busy_since = time.monotonic()
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine
                result, error = None, exc
            finally:
                self.busy_since = None
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
