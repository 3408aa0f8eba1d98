"""The dedicated thread that runs the model: each call's result comes back as an asyncio future."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Worker:
    """One thread that runs the calls handed to it, in order, off the event loop.

    Leaner than loop.run_in_executor (no concurrent.futures.Future, no chained callbacks):
    one queue put, one call_soon_threadsafe back. The hand-off is paid per batch, and on a
    small model it costs as much as the forward pass itself.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` in the worker thread; the future holds its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def stop(self) -> None:
        """Let the thread end once the calls already handed to it are done."""
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
