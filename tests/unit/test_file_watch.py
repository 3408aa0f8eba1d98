"""Waking on a file's change by inotify: an atomic replace, a write in place and a removal
each end a wait long before its fallback poll would, and another file of the same folder
does not."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from servemesh.services.runtime.file_watch import FileEvents

# Far longer than any test waits: a wait that ends sooner was woken by the kernel.
FALLBACK_S = 600.0


async def _woken(events: FileEvents, change: object) -> bool:
    """Whether a wait begun before `change()` ends within 10 s."""
    waiting = asyncio.ensure_future(events.wait(FALLBACK_S))
    await asyncio.sleep(0)  # the wait is parked before the change
    change()  # type: ignore[operator]
    try:
        await asyncio.wait_for(asyncio.shield(waiting), 10)
    except TimeoutError:
        waiting.cancel()
        return False
    return True


async def _follow(folder: Path) -> list[bool]:
    target = folder / "spec.json"
    target.write_text("{}")
    events = FileEvents(target)
    assert events.watching
    try:

        def replace() -> None:
            tmp = folder / ".spec.json.tmp"
            tmp.write_text('{"a": 1}')
            os.replace(tmp, target)

        found = [
            await _woken(events, replace),
            await _woken(events, lambda: target.write_text('{"a": 2}')),
            await _woken(events, target.unlink),
        ]
        # Another file of the folder: the wait runs on (cut short here by the test).
        other = asyncio.ensure_future(events.wait(FALLBACK_S))
        await asyncio.sleep(0)
        (folder / "other.json").write_text("{}")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(other), 0.3)
        other.cancel()
        return found
    finally:
        events.close()


def test_a_wait_ends_on_the_files_changes_only(tmp_path: Path) -> None:
    assert asyncio.run(_follow(tmp_path)) == [True, True, True]


def test_without_a_folder_to_watch_it_polls(tmp_path: Path) -> None:
    async def run() -> bool:
        events = FileEvents(tmp_path / "missing" / "spec.json", poll_s=0.01)
        try:
            await asyncio.wait_for(events.wait(FALLBACK_S), 5)  # the poll's 10 ms
            return events.watching
        finally:
            events.close()

    assert asyncio.run(run()) is False


def test_the_watches_of_one_loop_share_one_inotify_instance(tmp_path: Path) -> None:
    async def run() -> tuple[int, list[bool]]:
        a, b = tmp_path / "a.json", tmp_path / "b.json"
        first, second = FileEvents(a), FileEvents(b)
        try:
            instances = len({id(first._watches), id(second._watches)})
            woken = [
                await _woken(first, lambda: a.write_text("{}")),
                await _woken(second, lambda: b.write_text("{}")),
            ]
            return instances, woken
        finally:
            first.close()
            second.close()

    assert asyncio.run(run()) == (1, [True, True])
