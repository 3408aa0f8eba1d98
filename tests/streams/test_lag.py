"""Reading a group's lag while a consumer works: a reading that says settled (nothing
pending, nothing undelivered) is never taken while a batch is still being handled.

The consumer here takes a step (read a batch, or write its outputs and acknowledge it, as
the stream consumer does) after every command the reading client sends, the worst
interleaving there is. Read as separate commands, pending first, a batch taken between
them is in neither count and the stream looks settled with its outputs missing (seen in
the mesh's stream tests on a busy machine); read in one MULTI, nothing can come between.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from servemesh.spec import StreamSpec
from servemesh.streams.keys import StreamKeys
from servemesh.streams.metrics import read_lag_now

ENTRIES = 12
BATCH = 5


class StepwiseConsumer:
    """A consumer that moves one step each time it is told: read a batch, then write its
    outputs and acknowledge it."""

    def __init__(self, client: redis.Redis, keys: StreamKeys) -> None:
        self.client = client
        self.keys = keys
        self.batch: list[Any] = []

    def step(self) -> None:
        k = self.keys
        if self.batch:
            for entry_id in self.batch:
                self.client.xadd(k.output, {"event": entry_id})
            self.client.xack(k.input, k.group, *self.batch)
            self.batch = []
            return
        reply: Any = self.client.xreadgroup(k.group, "c", {k.input: ">"}, count=BATCH)
        self.batch = [entry_id for _stream, items in reply or [] for entry_id, _ in items]


class Interleaved(redis.Redis):
    """A client after whose `step_after`-th command of a reading the consumer takes a
    step (a reading in one round trip gives it no such point)."""

    consumer: StepwiseConsumer | None = None
    step_after = 0
    sent = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        answer = super().execute_command(*args, **options)
        if self.consumer is not None and self.sent == self.step_after:
            self.consumer.step()
        self.sent += 1
        return answer


# Every point inside a reading the consumer could act at (the reading is a handful of
# commands at most).
@pytest.mark.parametrize("step_after", range(6))
def test_a_settled_reading_means_every_entry_was_handled(redis_url: str, step_after: int) -> None:
    keys = StreamKeys.of(StreamSpec(name=f"lag-{uuid.uuid4().hex[:8]}", model="fraud"))
    setup = redis.Redis.from_url(redis_url)
    reader = Interleaved(connection_pool=redis.ConnectionPool.from_url(redis_url))
    try:
        setup.xgroup_create(keys.input, keys.group, "0", mkstream=True)
        for i in range(ENTRIES):
            setup.xadd(keys.input, {"n": str(i)})
        consumer = StepwiseConsumer(setup, keys)
        reader.consumer, reader.step_after = consumer, step_after
        readings: list[tuple[bool, int]] = []
        for _ in range(4 * ENTRIES):
            reader.sent = 0
            lag = read_lag_now(reader, keys)
            assert lag is not None
            readings.append((lag.settled, int(setup.xlen(keys.output))))
            consumer.step()  # and one step between readings
        early = [outputs for settled, outputs in readings if settled and outputs < ENTRIES]
        assert not early, f"settled while only {early[0]} of {ENTRIES} outputs were written"
        assert readings[-1] == (True, ENTRIES)
        assert not readings[0][0], "settled before the consumer read anything"
    finally:
        setup.delete(keys.input, keys.output)
        setup.close()
        reader.close()
        reader.connection_pool.disconnect()  # given, so not closed with the client
