"""The gateway's prediction log: a bounded buffer the request path appends to, and a
background task that hands batches to a store in a thread of its own.

A request never waits for the log and never fails because of it: `append` is a length
check and a list append; when the buffer is full the record is dropped and counted. The
flusher wakes every `flush_interval_ms`, or once `flush_records` are waiting, and writes
in one worker thread (file and database I/O, and the formatting of rows, stay off the
event loop). Write failures are counted, and each kind (a batch, the upkeep, the status
file) is logged at most once per ERROR_LOG_INTERVAL_S, so one kind never hides another;
a failed batch is not retried (a store that is down would otherwise pile up memory).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from servemesh.contract.atomic import atomic_write_text
from servemesh.predlog.record import PredictWatch, Row, RowContext, to_row
from servemesh.spec import MeshSpec, ModelInputSpec, PredictionLogSpec
from servemesh_api.gateway.v1 import gateway_pb2

log = logging.getLogger(__name__)

ERROR_LOG_INTERVAL_S = 60.0
# How often the writer deletes what is older than the retention (also at start).
EXPIRE_INTERVAL_S = 60.0
STATUS_FILE = "status.json"


class Store(Protocol):
    kind: str

    def describe(self) -> str: ...
    def write(self, rows: Sequence[Row]) -> None: ...
    def compact(self) -> None: ...
    def expire(self, before_ms: int) -> int: ...
    def close(self) -> None: ...


def predictions_dir(state_dir: str | Path) -> Path:
    """Where the Parquet files and each gateway's status file live."""
    return Path(state_dir) / "predictions"


def entity_names(spec: MeshSpec) -> dict[str, str]:
    """The entity a model's shorthand `entity_ids` name, by model."""
    return {
        name: spec.entity_of(model.feature_view)
        for name, model in spec.models.items()
        if model.inputs is None and model.feature_view in spec.feature_views
    }


def logged_features(spec: MeshSpec) -> dict[str, dict[str, ModelInputSpec]]:
    """The inputs of every model whose spec sets log_features, by model: the records of
    their calls keep the feature values, named by these inputs' features."""
    return {
        name: model.effective_inputs for name, model in spec.models.items() if model.log_features
    }


class PredictionLog:
    def __init__(
        self,
        settings: PredictionLogSpec,
        store: Store | None,
        context: RowContext,
        status_path: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.enabled = settings.enabled and store is not None
        self.store = store
        self.context = context
        self.status_path = status_path
        self.clock = clock
        self._buffer: list[PredictWatch] = []
        self._capacity = settings.buffer_records
        self._flush_at = settings.flush_records
        self._in_flight = 0
        self.accepted = 0
        self.written = 0
        self.dropped = 0
        self.write_errors = 0
        self._last_error_log: dict[str, float] = {}  # by message: when it was last logged
        self._last_expire = -EXPIRE_INTERVAL_S
        self._last_status: dict[str, int] | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        # One thread: batches are written in order, and a slow store slows only the log.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prediction-log")

    @classmethod
    def disabled(cls) -> PredictionLog:
        """A log that keeps nothing (a servicer built without one)."""
        return cls(PredictionLogSpec(enabled=False), None, RowContext("", ""))

    # --- the request path ------------------------------------------------------------

    def watch(
        self,
        request: gateway_pb2.PredictRequest,
        request_id: str,
        metadata: Sequence[tuple[str, Any]],
    ) -> PredictWatch:
        """A watch for one Predict: it times the call and appends its record at the end."""
        return PredictWatch(self.append, self.context.max_entity_ids, request, request_id, metadata)

    def append(self, record: PredictWatch) -> None:
        """Keep `record` for the writer, or drop and count it when the buffer is full."""
        if not self.enabled:
            return
        buffer = self._buffer
        if len(buffer) >= self._capacity:
            self.dropped += 1
            return
        buffer.append(record)
        self.accepted += 1
        if len(buffer) == self._flush_at:
            self._wake.set()

    # --- life cycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start flushing (in the running loop)."""
        if self.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Flush what is left, write the status one last time, close the store."""
        # The flag, not only the cancel, ends the flusher: a cancel that lands as its wake
        # fires can be lost (asyncio.wait_for on 3.11 returns the wait's result instead),
        # and the flusher would then wait out another interval, again and again.
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            # asyncio.wait: the flusher's end, whatever it is; a cancel of close itself
            # still reaches its caller.
            await asyncio.wait({self._task})
            self._task = None
        if self.enabled:
            await self.flush()
        loop = asyncio.get_running_loop()
        if self.store is not None:
            await loop.run_in_executor(self._executor, self.store.close)
        self._executor.shutdown(wait=True)

    async def follow_spec(self, spec: MeshSpec) -> None:
        """New models' shorthand entity names, which models keep their feature values;
        bounds as the spec now says."""
        settings = spec.prediction_log
        self.context = replace(
            self.context,
            max_output_bytes=settings.max_output_bytes,
            max_entity_ids=settings.max_entity_ids,
            max_message_chars=settings.max_message_chars,
            entity_of_model=entity_names(spec),
            max_feature_bytes=settings.max_feature_bytes,
            logged_features=logged_features(spec),
        )

    def stats(self) -> dict[str, int]:
        return {
            "accepted": self.accepted,
            "written": self.written,
            "dropped": self.dropped,
            "write_errors": self.write_errors,
            "buffered": len(self._buffer) + self._in_flight,
        }

    # --- the writer ------------------------------------------------------------------

    async def _run(self) -> None:
        interval = self.settings.flush_interval_ms / 1000
        while not self._closing:
            try:
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if self._closing:
                return  # close flushes what is left itself
            await self.flush()

    async def flush(self) -> None:
        """Hand what is buffered to the writer thread and wait for it."""
        batch, self._buffer = self._buffer, []
        self._in_flight = len(batch)
        written = asyncio.get_running_loop().run_in_executor(self._executor, self._write, batch)
        try:
            # Shielded: `close` cancels the flusher task, and a cancelled executor future
            # whose job had not started yet (the writer still busy with the batch before)
            # would drop this batch unwritten. The job runs; close waits for the executor.
            await asyncio.shield(written)
        finally:
            self._in_flight = 0

    def _write(self, batch: list[PredictWatch]) -> None:
        """In the writer thread: rows, the store, its upkeep, the status file."""
        assert self.store is not None
        now = self.clock()
        if batch:
            context = self.context
            try:
                self.store.write([to_row(c, context) for c in batch])
                self.written += len(batch)
            except Exception as exc:
                self.write_errors += 1
                self._log_error("prediction log: a batch could not be written", exc, len(batch))
        try:
            if batch:
                self.store.compact()
            if now - self._last_expire >= EXPIRE_INTERVAL_S:
                self._last_expire = now
                self.store.expire(int((now - self.settings.retention_s) * 1000))
        except Exception as exc:
            self.write_errors += 1
            self._log_error("prediction log: upkeep (merge, retention) failed", exc, 0)
        self._write_status(now)

    def _log_error(self, what: str, exc: Exception, records: int) -> None:
        now = time.monotonic()
        last = self._last_error_log.get(what)
        if last is not None and now - last < ERROR_LOG_INTERVAL_S:
            return
        self._last_error_log[what] = now
        log.warning(
            what,
            extra={
                "error": f"{type(exc).__name__}: {exc}"[:500],
                "records": records,
                "write_errors": self.write_errors,
            },
        )

    def _write_status(self, now: float) -> None:
        if self.status_path is None:
            return
        stats = self.stats()
        stats["buffered"] = len(self._buffer)  # this batch is written (or lost) by now
        if stats == self._last_status:
            return
        self._last_status = stats
        status = {
            "gateway": self.context.gateway,
            "zone": self.context.gateway_zone,
            "pid": os.getpid(),
            "store": self.store.describe() if self.store is not None else "",
            "updated": now,
            **stats,
        }
        try:
            atomic_write_text(self.status_path, json.dumps(status))
        except OSError as exc:
            self._log_error("prediction log: the status file could not be written", exc, 0)
