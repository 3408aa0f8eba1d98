"""The bounded buffer: appends never wait, a full buffer drops and counts, writes go on in
a thread, failures are counted and never raised, and drain flushes what is left."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from servemesh.predlog.buffer import PredictionLog
from servemesh.spec import PredictionLogSpec
from tests.predlog.records import CONTEXT, BlockedStore, captured
from tests.waiting import wait_until_async

NOW = 1_800_000_000.0


def _write_errors_are(log: PredictionLog, count: int) -> Callable[[], bool]:
    return lambda: log.stats()["write_errors"] == count


def _log(store: BlockedStore, status: Path | None = None, **settings: object) -> PredictionLog:
    spec = PredictionLogSpec.model_validate(
        {"flush_interval_ms": 60_000, "flush_records": 1, **settings}
    )
    return PredictionLog(spec, store, CONTEXT, status, clock=lambda: NOW)


async def test_a_full_buffer_drops_and_counts_while_the_writer_is_stuck(tmp_path: Path) -> None:
    store = BlockedStore()
    log = _log(store, tmp_path / "status.json", buffer_records=5)
    log.start()
    log.append(captured(NOW, request_id="first"))  # reaches flush_records: the flusher wakes
    await asyncio.to_thread(store.entered.wait, 30)  # ... and the writer now holds it
    for i in range(8):
        log.append(captured(NOW, request_id=f"r{i}"))
    assert log.stats() == {
        "accepted": 6,
        "written": 0,
        "dropped": 3,
        "write_errors": 0,
        "buffered": 6,
    }
    store.release.set()
    await log.close()  # drain: what is buffered is written
    assert [r[1] for r in store.rows] == ["first", "r0", "r1", "r2", "r3", "r4"]
    assert log.stats()["written"] == 6 and log.stats()["buffered"] == 0
    status = json.loads((tmp_path / "status.json").read_text())
    assert (status["gateway"], status["dropped"], status["written"]) == ("gateway-zone-a-0", 3, 6)


async def test_closing_while_a_batch_waits_for_the_writer_thread_loses_none_of_it() -> None:
    # The batch is handed over while the writer thread is still busy: its job waits in the
    # executor's queue when close cancels the flusher. It must still be written.
    store = BlockedStore()
    store.release.set()
    log = _log(store)
    busy = asyncio.Event()
    go_on = asyncio.Event()
    loop = asyncio.get_running_loop()

    def occupy_the_writer() -> None:
        loop.call_soon_threadsafe(busy.set)
        asyncio.run_coroutine_threadsafe(go_on.wait(), loop).result(30)

    occupied = loop.run_in_executor(log._executor, occupy_the_writer)
    await busy.wait()
    log.append(captured(NOW, request_id="queued"))
    flushing = asyncio.ensure_future(log.flush())
    await asyncio.sleep(0)  # the flush hands its batch over: the job is queued
    flushing.cancel()
    go_on.set()
    await occupied
    await log.close()
    assert [r[1] for r in store.rows] == ["queued"]
    assert log.stats()["written"] == 1


async def test_closing_as_the_flusher_wakes_returns_at_once() -> None:
    # The append wakes the flusher and close cancels it in the same turn of the loop: the
    # wake completes first, which is when a cancel can be lost. Close must still return
    # within this test's time, not a flush interval (60 s) later, again and again.
    store = BlockedStore()
    store.release.set()
    log = _log(store)
    log.start()
    await asyncio.sleep(0)  # one turn: the flusher is now waiting for its wake
    log.append(captured(NOW, request_id="last"))
    closing = asyncio.ensure_future(log.close())
    # asyncio.wait, not wait_for: a cancel on timeout would be taken by close as its own.
    done, _ = await asyncio.wait({closing}, timeout=10)
    assert closing in done, "close still waits for the flusher"
    assert [r[1] for r in store.rows] == ["last"]


async def test_a_failing_store_is_counted_and_the_log_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = BlockedStore()
    store.release.set()
    store.fail = True
    log = _log(store)
    log.start()
    for i in range(3):
        log.append(captured(NOW, request_id=f"r{i}"))
        await wait_until_async(_write_errors_are(log, i + 1), "a failed write")
    # Counted every time, logged once per interval.
    assert [r.getMessage() for r in caplog.records].count(
        "prediction log: a batch could not be written"
    ) == 1
    store.fail = False
    log.append(captured(NOW, request_id="after"))
    await wait_until_async(lambda: log.stats()["written"] == 1, "a write after the failures")
    await log.close()
    assert [r[1] for r in store.rows] == ["after"]


async def test_each_kind_of_failure_is_logged_though_another_was_just_logged(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A status file that cannot be written must not hide, for the whole interval, that
    the batches are being lost too (and the other way round)."""
    store = BlockedStore()
    store.release.set()
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the status file's folder should be\n")
    log = _log(store, blocked / "status.json")
    log.start()
    log.append(captured(NOW, request_id="ok"))  # written; only its status fails
    await wait_until_async(lambda: log.stats()["written"] == 1, "the first write")
    store.fail = True
    log.append(captured(NOW, request_id="lost"))
    await wait_until_async(_write_errors_are(log, 1), "the failed batch")
    await log.close()
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("prediction log: the status file could not be written") == 1
    assert messages.count("prediction log: a batch could not be written") == 1


async def test_batches_wait_for_the_interval_or_flush_records() -> None:
    store = BlockedStore()
    store.release.set()
    log = _log(store, flush_records=3)
    log.start()
    log.append(captured(NOW))
    log.append(captured(NOW))
    await asyncio.sleep(0)  # let the flusher run if it (wrongly) woke
    assert not store.entered.is_set() and log.stats()["buffered"] == 2
    log.append(captured(NOW))
    await wait_until_async(lambda: log.stats()["written"] == 3, "a batch of flush_records")
    await log.close()


async def test_the_writer_deletes_what_the_retention_lets_go() -> None:
    store = BlockedStore()
    store.release.set()
    log = _log(store, retention="2d")
    log.start()
    log.append(captured(NOW))
    await wait_until_async(lambda: log.stats()["written"] == 1, "a write")
    await log.close()
    assert store.expired_before and store.expired_before[0] == int((NOW - 2 * 86400) * 1000)


async def test_a_disabled_log_keeps_nothing() -> None:
    log = PredictionLog.disabled()
    log.start()
    log.append(captured(NOW))
    assert log.stats()["accepted"] == 0
    await log.close()
