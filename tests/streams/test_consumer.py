"""The consumer against real Redis, the demo model in process: delivery exactly once in
effect under redelivery, poison to the dead-letter stream, transient failures retried,
dead consumers' entries claimed, lag read back."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from servemesh.contract.demo import DEMO_FEATURES, demo_features
from servemesh.streams.events import Event
from servemesh.streams.metrics import StreamMetrics, read_lag
from servemesh.streams.predict import Outcome, Transient
from tests.streams.kit import ENTITIES, StreamKit, drain, make_kit, run_until


@pytest.fixture
async def kit(redis_url: str, tmp_path: Path) -> AsyncIterator[StreamKit]:
    kit = await make_kit(redis_url, tmp_path)
    yield kit
    await kit.close()


def one_each(outputs: Sequence[tuple[str, dict[str, str]]], ids: Sequence[str]) -> None:
    """Every input id has exactly one output entry, and nothing else is there."""
    counts = Counter(fields["event"] for _, fields in outputs)
    assert sorted(counts) == sorted(ids), "an event without an output, or an output of none"
    twice = {event: n for event, n in counts.items() if n > 1}
    assert not twice, f"events with more than one output entry: {twice}"


async def test_each_event_gets_one_prediction_and_is_acknowledged(kit: StreamKit) -> None:
    ids = await kit.send(130)
    consumer = kit.consumer()

    async def done() -> bool:
        return await kit.redis.xlen(kit.keys.output) >= len(ids)

    await drain(consumer, done)
    outputs = await kit.outputs()
    one_each(outputs, ids)
    rows = demo_features(ENTITIES)
    first = outputs[0][1]
    assert first["entity"] == "user-0" and first["model"] == "fraud" and first["version"] == "v1"
    score = json.loads(first["outputs"])["score"]
    assert score == pytest.approx(kit.expected_score(rows["user-0"]), rel=1e-5)
    lag = await read_lag(kit.redis, kit.keys)
    assert lag is not None and lag.pending == 0 and lag.undelivered == 0
    assert consumer.metrics.counts["predicted"] == len(ids)


async def test_a_crash_between_write_and_ack_redelivers_without_a_second_output(
    kit: StreamKit,
) -> None:
    ids = await kit.send(200)
    crashed: list[list[str]] = []

    async def crash(batch: list[str]) -> None:
        if len(crashed) < 2:  # the first two batches: written, never acknowledged
            crashed.append(batch)
            raise SystemExit("killed between write and ack")

    first = kit.consumer(name="c-0", after_write=crash)
    await first.ensure_group()
    for _ in range(2):
        with pytest.raises(SystemExit):
            await first.step()
    lag = await read_lag(kit.redis, kit.keys)
    assert lag is not None and lag.pending == sum(map(len, crashed)) > 0
    written_before = await kit.redis.xlen(kit.keys.output)
    assert written_before == lag.pending  # their outputs are there, unacknowledged

    # The same consumer back (its own pending entries first), then all the rest.
    again = kit.consumer(name="c-0")

    async def done() -> bool:
        lag = await read_lag(kit.redis, kit.keys)
        return lag is not None and lag.pending == 0 and lag.undelivered == 0

    await drain(again, done)
    one_each(await kit.outputs(), ids)
    assert again.metrics.counts["redelivered"] == written_before
    assert again.metrics.counts["predicted"] == len(ids)


async def test_a_dead_consumers_entries_are_claimed_by_another(
    redis_url: str, tmp_path: Path
) -> None:
    kit = await make_kit(redis_url, tmp_path, claim_min_idle="50ms", batch_size=16)
    try:
        await claimed_by_another(kit)
    finally:
        await kit.close()


async def claimed_by_another(kit: StreamKit) -> None:
    ids = await kit.send(40)
    dead = kit.consumer(name="gone")
    await dead.ensure_group()
    taken = await dead.read_batch()  # read, never handled: the consumer died here
    assert len(taken) == 16
    survivor = kit.consumer(name="survivor")

    async def done() -> bool:
        lag = await read_lag(kit.redis, kit.keys)
        return lag is not None and lag.pending == 0 and lag.undelivered == 0

    await run_until(survivor, done)
    one_each(await kit.outputs(), ids)
    pending = await kit.redis.xpending(kit.keys.input, kit.keys.group)
    assert pending["pending"] == 0


async def test_poison_goes_to_the_dead_letter_stream_with_its_reason(kit: StreamKit) -> None:
    good = await kit.send(10)
    bad = [
        *(await kit.send(1, other="no entity field")),
        *(await kit.send(1, entity="no-such-user")),
        *(await kit.send(1, entity="user-1", features="{not json")),
        *(await kit.send(1, entity="user-1", features=json.dumps({"f00": 1.0}))),
        *(await kit.send(1, entity="user-1", features=json.dumps({"nope": {"f00": 1}}))),
    ]
    more = await kit.send(10)
    consumer = kit.consumer()

    async def done() -> bool:
        lag = await read_lag(kit.redis, kit.keys)
        return lag is not None and lag.pending == 0 and lag.undelivered == 0

    await drain(consumer, done)
    one_each(await kit.outputs(), good + more)
    dead = {d["event"]: d["reason"] for d in await kit.dead()}
    assert sorted(dead) == sorted(bad)
    assert "entity: missing" in dead[bad[0]]
    assert "NOT_FOUND" in dead[bad[1]] and "no-such-user" in dead[bad[1]]
    assert "not JSON" in dead[bad[2]]
    assert "lacks" in dead[bad[3]]
    assert "not a view the model reads" in dead[bad[4]]
    assert consumer.metrics.counts["dead_lettered"] == len(bad)


async def test_feature_values_in_an_event_are_written_before_it_is_scored(
    kit: StreamKit,
) -> None:
    row = np.linspace(-1.0, 1.0, len(DEMO_FEATURES)).astype(np.float32)
    values = {f: float(v) for f, v in zip(DEMO_FEATURES, row, strict=True)}
    ids = await kit.send(1, entity="user-7", features=json.dumps(values))

    async def done() -> bool:
        return await kit.redis.xlen(kit.keys.output) >= 1

    await drain(kit.consumer(), done)
    (_, fields), *_ = await kit.outputs()
    assert fields["event"] == ids[0]
    score = json.loads(fields["outputs"])["score"]
    assert score == pytest.approx(kit.expected_score(row), rel=1e-5)


class Flaky:
    """Answers UNAVAILABLE a few times, then as the real predictor does."""

    def __init__(self, real: object, failures: int) -> None:
        self.real = real
        self.failures = failures

    async def predict(self, events: Sequence[Event]) -> list[Outcome]:
        if self.failures:
            self.failures -= 1
            raise Transient("UNAVAILABLE", "no healthy upstream")
        return await self.real.predict(events)  # type: ignore[attr-defined]

    async def close(self) -> None:
        pass


async def test_transient_failures_are_retried_never_dead_lettered(kit: StreamKit) -> None:
    ids = await kit.send(20)
    metrics = StreamMetrics(kit.stream.name)
    consumer = kit.consumer(predictor=Flaky(kit.predictor(), failures=3), metrics=metrics)

    async def done() -> bool:
        lag = await read_lag(kit.redis, kit.keys)
        return lag is not None and lag.pending == 0 and lag.undelivered == 0

    await run_until(consumer, done)
    one_each(await kit.outputs(), ids)
    assert await kit.dead() == []
    assert metrics.retry_count == 3
    sample = metrics.registry.get_sample_value(
        "servemesh_stream_retries_total", {"stream": kit.stream.name, "code": "UNAVAILABLE"}
    )
    assert sample == 3


async def test_lag_counts_pending_entries_and_their_age(kit: StreamKit) -> None:
    await kit.send(30)
    consumer = kit.consumer(name="slow")
    await consumer.ensure_group()
    assert await read_lag(kit.redis, kit.keys) is not None
    taken = await consumer.read_batch()
    lag = await read_lag(kit.redis, kit.keys)
    assert lag is not None
    assert lag.pending == len(taken) and lag.undelivered == 30 - len(taken)
    assert lag.length == 30 and lag.consumers == 1
    assert lag.oldest_pending_age_s >= 0
    metrics = StreamMetrics("x")
    metrics.observe_lag(lag)
    assert metrics.registry.get_sample_value(
        "servemesh_stream_pending_entries", {"stream": "x"}
    ) == len(taken)
