"""The consumer: a member of the stream's consumer group that turns events into predictions.

Each round takes a batch: first entries of dead consumers idle past `claim_min_idle`
(XAUTOCLAIM), then this consumer's own pending entries (after a restart, or a transient
failure), then new ones (XREADGROUP `>`). A batch is checked (poison is dead-lettered with
its reason), its feature values written, scored, and its outputs and dead letters written
by one script that skips every event whose `done` marker exists (keys.py); only then is it
acknowledged (XACK). So a crash anywhere before the XACK redelivers the batch, and the
redelivery writes nothing twice: at least once, exactly once in effect.

A transient failure (the mesh UNAVAILABLE, a deadline, Redis gone) leaves the batch
pending, waits (doubling, up to MAX_BACKOFF_S) and reads it again; the consumer never
stops for it and never dead-letters it. `stop` ends the loop between batches: the batch in
flight is finished first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis

from servemesh.spec import ResolvedSpec, StreamSpec
from servemesh.spec.durations import duration_seconds
from servemesh.spec.store_clients import store_writer
from servemesh.streams.events import Event, Poison, parse_event
from servemesh.streams.keys import StreamKeys, id_ms, text
from servemesh.streams.metrics import StreamMetrics, read_lag
from servemesh.streams.predict import (
    FeatureWriter,
    Prediction,
    Predictor,
    Transient,
    encode_outputs,
)

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
FIRST_BACKOFF_S = 0.05
STATS_EVERY_S = 1.0

# KEYS: pairs (target stream, done marker); ARGV[1] marker TTL (s), ARGV[2] approximate
# MAXLEN, then per pair: a field count and the fields. An event whose marker exists is
# skipped: its output (or dead letter) is there already. Answers how many were written.
_WRITE = """
local ttl = ARGV[1]
local maxlen = ARGV[2]
local a = 3
local written = 0
for i = 1, #KEYS, 2 do
  local n = tonumber(ARGV[a])
  local fields = {}
  for j = 1, 2 * n do fields[j] = ARGV[a + j] end
  a = a + 2 * n + 1
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then
    local id = redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', unpack(fields))
    redis.call('SET', KEYS[i + 1], id, 'EX', ttl)
    written = written + 1
  end
end
return written
"""

Entry = tuple[str, dict[Any, Any] | None]
# Called after a batch's outputs are written and before it is acknowledged (tests and the
# drill's crash point); given the batch's event ids.
Hook = Callable[[list[str]], Awaitable[None]]


def stream_client(spec: ResolvedSpec, stream: StreamSpec) -> aioredis.Redis:
    """The Redis holding the stream: the spec's own for it, else the mesh's."""
    if stream.redis_url is None:
        # The feature store's: its primary, followed through a failover when replicated.
        return store_writer(spec, socket_connect_timeout=2.0, health_check_interval=10)
    url, password = stream.redis_url, None
    if stream.password_file is not None:
        from pathlib import Path

        password = Path(stream.password_file).read_text().strip() or None
    return aioredis.Redis.from_url(
        url, password=password, socket_connect_timeout=2.0, health_check_interval=10
    )


class Consumer:
    def __init__(
        self,
        client: aioredis.Redis,
        spec: ResolvedSpec,
        stream: StreamSpec,
        predictor: Predictor,
        *,
        writer: FeatureWriter | None = None,
        consumer: str | None = None,
        metrics: StreamMetrics | None = None,
        after_write: Hook | None = None,
        metrics_address: str = "",
    ) -> None:
        self.client = client
        self.spec = spec
        self.stream = stream
        self.keys = StreamKeys.of(stream)
        self.predictor = predictor
        self.writer = writer
        self.name = consumer or f"{stream.name}-0"
        self.metrics = metrics or StreamMetrics(stream.name)
        self.after_write = after_write
        self.metrics_address = metrics_address
        self.views = spec.models[stream.model].views
        self.min_idle_ms = int(duration_seconds(stream.claim_min_idle) * 1000)
        self.ttl_s = max(1, int(duration_seconds(stream.dedup_ttl)))
        self._write = client.register_script(_WRITE)
        self._own_pending = True  # after a start, this consumer's earlier entries first
        self._claim_from = "0-0"
        self._next_claim = 0.0
        self._next_stats = 0.0

    # --- the loop ----------------------------------------------------------------------

    async def ensure_group(self) -> None:
        start = "0" if self.stream.start == "earliest" else "$"
        try:
            await self.client.xgroup_create(self.keys.input, self.keys.group, start, mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until `stop` is set (finishing the batch in flight)."""
        await self.ensure_group()
        backoff = FIRST_BACKOFF_S
        while not stop.is_set():
            try:
                await self.step()
                backoff = FIRST_BACKOFF_S
            except (Transient, redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                code = exc.code if isinstance(exc, Transient) else type(exc).__name__
                self.metrics.retried(code)
                self._own_pending = True
                log.warning(
                    "transient failure; the batch stays pending",
                    extra={"stream": self.stream.name, "code": code, "error": str(exc)[:200]},
                )
                try:
                    await asyncio.wait_for(stop.wait(), backoff)
                except TimeoutError:
                    pass
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            await self._maybe_publish_stats()
        await self._publish_stats()

    async def step(self) -> int:
        """One batch: read, handle, acknowledge. How many entries it took."""
        entries = await self.read_batch()
        if entries:
            await self.handle(entries)
        return len(entries)

    async def read_batch(self) -> list[Entry]:
        count = self.stream.batch_size
        now = time.monotonic()
        if now >= self._next_claim:
            claimed = await self._autoclaim(count)
            if claimed:
                return claimed
            self._next_claim = now + max(0.05, self.min_idle_ms / 2000)
        if self._own_pending:
            entries = await self._read("0", count, block=None)
            if entries:
                return entries
            self._own_pending = False
        return await self._read(">", count, block=self.stream.block_ms)

    async def _read(self, start: str, count: int, block: int | None) -> list[Entry]:
        reply: Any = await self.client.xreadgroup(
            self.keys.group, self.name, {self.keys.input: start}, count=count, block=block
        )
        entries: list[Entry] = []
        for _stream, items in reply or []:
            entries += [(text(entry_id), fields) for entry_id, fields in items]
        return entries

    async def _autoclaim(self, count: int) -> list[Entry]:
        reply = await self.client.xautoclaim(
            self.keys.input,
            self.keys.group,
            self.name,
            self.min_idle_ms,
            start_id=self._claim_from,
            count=count,
        )
        next_id, items = reply[0], reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        self._claim_from = text(next_id)
        if deleted:  # entries trimmed away while pending: nothing to score, let them go
            await self.client.xack(self.keys.input, self.keys.group, *deleted)
        entries = [(text(entry_id), fields) for entry_id, fields in items]
        if entries:
            log.info(
                "claimed the pending entries of a consumer that stopped",
                extra={"stream": self.stream.name, "entries": len(entries)},
            )
        return entries

    # --- one batch -----------------------------------------------------------------------

    async def handle(self, entries: Sequence[Entry]) -> None:
        now_ms = int(time.time() * 1000)
        events: list[Event] = []
        dead: list[tuple[str, dict[Any, Any] | None, str]] = []
        for entry_id, fields in entries:
            if not fields:
                dead.append((entry_id, fields, "the entry was deleted before it was scored"))
                continue
            try:
                events.append(parse_event(entry_id, fields, self.views, now_ms))
            except Poison as exc:
                dead.append((entry_id, fields, str(exc)))
        if self.writer is not None and any(e.features for e in events):
            refused = await self.writer.write([e for e in events if e.features])
            if refused:
                by_id = dict(entries)
                dead += [(i, by_id.get(i), str(p)) for i, p in refused.items()]
                events = [e for e in events if e.id not in refused]
        outcomes = await self.predictor.predict(events) if events else []
        predicted: list[tuple[Event, Prediction]] = []
        for event, outcome in zip(events, outcomes, strict=True):
            if isinstance(outcome, Prediction):
                predicted.append((event, outcome))
            else:
                fields = dict(entries).get(event.id)
                dead.append((event.id, fields, str(outcome) or "refused"))
        written = await self._write_results(predicted, dead)
        ids = [entry_id for entry_id, _ in entries]
        if self.after_write is not None:
            await self.after_write(ids)
        await self.client.xack(self.keys.input, self.keys.group, *ids)
        self.metrics.handled("predicted", len(predicted))
        self.metrics.handled("dead_lettered", len(dead))
        self.metrics.handled("redelivered", len(predicted) + len(dead) - written)
        self.metrics.batch_done(len(ids))
        done_ms = time.time() * 1000
        for event, _answer in predicted:
            self.metrics.latency.labels(self.stream.name).observe(
                max(0.0, done_ms - id_ms(event.id)) / 1000
            )
        if dead:
            log.warning(
                "poison events dead-lettered",
                extra={"stream": self.stream.name, "events": len(dead), "first": dead[0][2]},
            )

    async def _write_results(
        self,
        predicted: Sequence[tuple[Event, Prediction]],
        dead: Sequence[tuple[str, dict[Any, Any] | None, str]],
    ) -> int:
        keys: list[str] = []
        args: list[str | int] = [self.ttl_s, self.stream.max_output_entries]
        for event, answer in predicted:
            keys += [self.keys.output, self.keys.done(event.id)]
            fields = {
                "event": event.id,
                "entity": event.label,
                "model": answer.model,
                "version": answer.version,
                "outputs": encode_outputs(answer.outputs),
                "degraded": "1" if answer.degraded else "0",
                "request_id": answer.request_id,
            }
            args += [len(fields), *(x for kv in fields.items() for x in kv)]
        for entry_id, raw, reason in dead:
            keys += [self.keys.dead_letter, self.keys.done(entry_id)]
            shown = {text(k): text(v) for k, v in (raw or {}).items()}
            fields = {"event": entry_id, "reason": reason, "entry": json.dumps(shown)[:4096]}
            args += [len(fields), *(x for kv in fields.items() for x in kv)]
        if not keys:
            return 0
        return int(await self._write(keys=keys, args=args))

    # --- what `stream status` reads -------------------------------------------------------

    async def _maybe_publish_stats(self) -> None:
        if time.monotonic() >= self._next_stats:
            try:
                await self._publish_stats()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                pass

    async def _publish_stats(self) -> None:
        self._next_stats = time.monotonic() + STATS_EVERY_S
        lag = await read_lag(self.client, self.keys)
        if lag is not None:
            self.metrics.observe_lag(lag)
        counts = self.metrics.counts
        await self.client.hset(
            self.keys.stats,
            mapping={
                "consumer": self.name,
                "pid": os.getpid(),
                "predicted": counts.get("predicted", 0),
                "dead_lettered": counts.get("dead_lettered", 0),
                "redelivered": counts.get("redelivered", 0),
                "retries": self.metrics.retry_count,
                "events_per_second": round(self.metrics.events_per_second(), 2),
                "updated_ms": int(time.time() * 1000),
                "metrics": self.metrics_address,
            },
        )


def latency_ms(event_id: str, output_id: str) -> int:
    """Event to prediction: the output entry's time less the input entry's (one clock)."""
    return id_ms(output_id) - id_ms(event_id)
