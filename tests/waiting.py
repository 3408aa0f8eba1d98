"""Waiting for a condition in a test: poll until it holds, or fail naming what never came.

A test never sleeps to let something happen; it waits for the thing itself, with a bound
far above its normal time, so a slow or busy machine only makes it slower, never red.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None], what: str, *, timeout_s: float = 30.0, every_s: float = 0.05
) -> T:
    """The first truthy value `condition` returns; fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s:.0f} s for {what}; last seen: {value!r}")
        time.sleep(every_s)


async def wait_until_async(
    condition: Callable[[], T | None], what: str, *, timeout_s: float = 30.0, every_s: float = 0.01
) -> T:
    """As wait_until, without blocking the event loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s:.0f} s for {what}; last seen: {value!r}")
        await asyncio.sleep(every_s)
