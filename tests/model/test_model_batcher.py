"""The dynamic batcher: sharing, shedding, deadlines, priorities and failure isolation.

Time is a ManualClock that only the test moves, and the model (the demo MLP, or a tiny
TorchScript module) sits behind a gate the test opens: "the model is busy", "40 ms have
passed" and "the batch loop has planned its wait" are facts a test sets up or waits for,
never sleeps it hopes were long enough. `enqueue` admits or refuses without waiting, so a
refusal raised by it is a refusal "at once".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from servemesh.contract.demo import Artifact, torchscript_artifact
from servemesh.services.model.batching import (
    DISPATCH_SLACK_S,
    DISPATCH_SLACK_SHARE,
    ArrivalOverlap,
    Batcher,
    ManualClock,
)
from servemesh.services.model.errors import DeadlineMissed, InferenceFailed, QueueFull, Unavailable
from servemesh.services.model.latency import LatencyTable
from servemesh.spec import BatchingSpec
from tests.model.model_helpers import (
    GatedModel,
    array_of,
    demo_runner,
    marked,
    reference_scores,
    rows,
)

# A scheduling bug shows as a batch that never leaves; fail in a minute, not at the run's end.
pytestmark = pytest.mark.timeout(60)

BATCHER_LOG = "servemesh.services.model.batching.batcher"
LONG = 10.0  # seconds: a deadline that never matters

Made = tuple[Batcher, GatedModel, ManualClock]
Make = Callable[..., Awaitable[Made]]


@pytest.fixture
async def make(artifacts: dict[int, Artifact]) -> AsyncIterator[Make]:
    """Builds batchers on a ManualClock over the demo model (or `artifact`); closes them all.

    `expected_ms` seeds the expected milliseconds per batch size (default: 1 ms for one
    row, 2 ms for a full batch); `held=True` holds every batch at the model's door.
    """
    made: list[Made] = []

    async def build(
        artifact: Artifact | None = None,
        *,
        expected_ms: dict[int, float] | None = None,
        held: bool = False,
        **batching: Any,
    ) -> Made:
        spec = BatchingSpec(**batching)
        clock = ManualClock()
        model = GatedModel(
            demo_runner(artifact or artifacts[1], spec.max_batch_size), clock, held=held
        )
        expected = expected_ms or {1: 1.0, spec.max_batch_size: 2.0}
        batcher = Batcher(
            model,
            spec,
            name="fraud:v1",
            expected_s={size: ms / 1000 for size, ms in expected.items()},
            clock=clock,
        )
        made.append((batcher, model, clock))
        return batcher, model, clock

    yield build
    for batcher, model, clock in made:
        model.open()
        clock.advance(3600)  # whatever a broken batcher still waits for has come
        await batcher.close()


def after(clock: ManualClock, seconds: float = LONG) -> float:
    """The deadline `seconds` from the clock's present reading."""
    return clock.now() + seconds


# --- sharing forward passes --------------------------------------------------------------


async def test_concurrent_submits_share_a_forward_pass(make: Make) -> None:
    batcher, model, clock = await make(max_batch_size=16, max_queue_delay_ms=20)
    # All 16 are queued before the batch loop first runs, and 16 rows fill a batch.
    results = await asyncio.gather(
        *(batcher.submit(rows(1, seed=i), after(clock), f"r{i}") for i in range(16))
    )
    assert [array_of(r).shape for r in results] == [(1, 1)] * 16
    assert [len(batch) for batch in model.batches] == [16]
    assert batcher.stats.executions == 1
    assert batcher.stats.inference_count == 16 and batcher.stats.outcomes["ok"] == 16


async def test_batched_results_equal_unbatched_row_by_row(
    make: Make, reference: dict[int, torch.jit.ScriptModule]
) -> None:
    batcher, model, clock = await make(max_batch_size=20, max_queue_delay_ms=20)
    requests = [rows(n, seed=i) for i, n in enumerate([1, 2, 3, 1, 2, 3, 1, 2, 3, 2])]
    answers = [batcher.enqueue(r, after(clock), f"r{i}") for i, r in enumerate(requests)]
    results = await asyncio.gather(*answers)
    assert [len(batch) for batch in model.batches] == [20]  # one forward pass for all ten
    for request, result in zip(requests, results, strict=True):
        # Batched matmuls may sum in another order: equal up to float rounding.
        np.testing.assert_allclose(
            array_of(result), reference_scores(reference[1], request), rtol=1e-5, atol=1e-6
        )


async def test_request_larger_than_a_batch_runs_alone(make: Make) -> None:
    batcher, model, clock = await make(max_batch_size=4, max_queue_delay_ms=0)
    big = batcher.enqueue(rows(10), after(clock), "big")
    small = batcher.enqueue(rows(1), after(clock), "small")
    assert array_of(await big).shape == (10, 1) and array_of(await small).shape == (1, 1)
    assert [len(batch) for batch in model.batches] == [10, 1]  # not split, not joined


# --- admission ---------------------------------------------------------------------------


async def test_full_queue_sheds_at_once_with_resource_exhausted(make: Make) -> None:
    batcher, _, clock = await make(
        max_batch_size=64, max_queue_delay_ms=1000, max_queue_size=2, dispatch="fixed_window"
    )
    queued = [batcher.enqueue(rows(1), after(clock), f"r{i}") for i in range(2)]
    with pytest.raises(QueueFull) as caught:
        batcher.enqueue(rows(1), after(clock), "one-too-many")  # a plain call: no waiting
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.message == "queue full (2 waiting)"
    assert batcher.stats.outcomes["shed"] == 1
    await batcher.close()  # drains: the two queued requests are still answered
    assert [array_of(await answer).shape for answer in queued] == [(1, 1), (1, 1)]


async def test_request_that_cannot_meet_its_deadline_is_refused_at_once(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=BATCHER_LOG)
    batcher, model, clock = await make(max_batch_size=4, expected_ms={1: 100.0, 4: 100.0})
    with pytest.raises(DeadlineMissed) as caught:
        batcher.enqueue(rows(1), after(clock, 0.03), "hopeless")  # a plain call: no waiting
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert caught.value.message == (
        "deadline cannot be met: 30.0 ms left, inference takes ~100.0 ms"
    )
    assert batcher.stats.executions == 0 and not model.batches
    assert batcher.stats.outcomes["refused"] == 1
    [record] = [r for r in caplog.records if r.getMessage() == "dropped: deadline cannot be met"]
    assert vars(record)["request_id"] == "hopeless"
    assert (vars(record)["expected_ms"], vars(record)["remaining_ms"]) == (100.0, 30.0)


async def test_request_that_can_no_longer_make_it_is_refused_at_the_door_alike(
    make: Make,
) -> None:
    batcher, model, clock = await make(
        max_batch_size=1, max_queue_delay_ms=0, held=True, expected_ms={1: 40.0}
    )
    busy = batcher.enqueue(marked(1.0), after(clock), "busy")
    await model.entered()
    # 60 ms left when it arrives: enough for a 40 ms batch, so it is admitted.
    tight = batcher.enqueue(marked(2.0), after(clock, 0.06), "tight")
    clock.advance_to(0.04)  # the busy batch takes 40 ms: 20 ms are left, the model needs 40
    model.release()
    with pytest.raises(DeadlineMissed) as caught:
        await tight
    # The same refusal as at admission, not an expiry.
    assert caught.value.message == "deadline cannot be met: 20.0 ms left, inference takes ~40.0 ms"
    assert array_of(await busy).shape == (1, 1)
    assert not model.saw(2.0)
    assert batcher.stats.outcomes["refused"] == 1 and batcher.stats.outcomes["expired"] == 0


async def test_close_finishes_queued_requests_then_refuses_new_ones(make: Make) -> None:
    batcher, _, clock = await make(
        max_batch_size=64, max_queue_delay_ms=1000, dispatch="fixed_window"
    )
    queued = [batcher.enqueue(rows(1, i), after(clock), f"r{i}") for i in range(3)]
    assert await clock.parked() == pytest.approx(1.0)  # waiting for company until t=1 s
    await batcher.close()  # the clock never moves: the queue delay is not waited out at drain
    assert [array_of(await answer).shape for answer in queued] == [(1, 1)] * 3
    with pytest.raises(Unavailable):
        batcher.enqueue(rows(1), after(clock), "after-close")
    assert batcher.stats.outcomes["closed"] == 1


# --- deadlines ---------------------------------------------------------------------------


async def test_expired_requests_never_reach_the_model(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=BATCHER_LOG)
    batcher, model, clock = await make(
        max_batch_size=1, max_queue_delay_ms=0, held=True, expected_ms={1: 40.0}
    )
    ahead = [batcher.enqueue(marked(i), after(clock), f"ahead-{i}") for i in range(3)]
    await model.entered()  # ahead-0 is in the model; two more wait before the one below
    # 80 ms is enough for one 40 ms batch (admitted), not for the 120 ms of higher-priority
    # work ahead of it.
    late = batcher.enqueue(marked(7.0), after(clock, 0.08), "late-one", priority=1)
    clock.advance_to(0.04)
    model.release()
    await model.entered()  # ahead-1 is in the model
    clock.advance_to(0.08)  # late-one's deadline passes while it waits
    with pytest.raises(DeadlineMissed) as caught:
        await late
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert caught.value.message == "deadline exceeded after 80.0 ms in queue"
    model.open()
    await asyncio.gather(*ahead)
    assert not model.saw(7.0)
    assert batcher.stats.inference_count == 3
    assert batcher.stats.outcomes["expired"] == 1
    [record] = [r for r in caplog.records if r.getMessage() == "dropped expired request"]
    assert vars(record)["request_id"] == "late-one"
    assert (vars(record)["late_ms"], vars(record)["queue_wait_ms"]) == (0.0, 80.0)


async def test_answer_that_would_come_after_the_deadline_is_reported_late(make: Make) -> None:
    batcher, model, clock = await make(
        max_batch_size=1, max_queue_delay_ms=0, held=True, expected_ms={1: 10.0}
    )
    answer = batcher.enqueue(rows(1), after(clock, 0.05), "slow")
    await model.entered()
    clock.advance_to(0.05)  # the forward pass runs past the deadline
    with pytest.raises(DeadlineMissed, match="deadline exceeded during inference"):
        await answer
    model.open()
    await batcher.close()
    assert batcher.stats.executions == 1  # it did run; its answer is dropped, never late
    assert batcher.stats.outcomes["late"] == 1 and batcher.stats.outcomes["ok"] == 0


async def test_forming_batch_leaves_early_for_its_deadline(make: Make) -> None:
    batcher, model, clock = await make(
        max_batch_size=64,
        max_queue_delay_ms=1000,
        dispatch="fixed_window",
        expected_ms={1: 10.0, 64: 20.0},
    )
    answer = batcher.enqueue(rows(1), after(clock, 0.15), "in-a-hurry")
    leave = await clock.parked()
    # It waits for company, but not the whole second: it leaves in time for its expected
    # 10 ms forward pass, with the dispatch slack on top.
    assert leave is not None
    assert leave == pytest.approx(0.15 - 0.01 * (1 + DISPATCH_SLACK_SHARE) - DISPATCH_SLACK_S)
    assert not answer.done()
    clock.advance_to(leave)
    assert array_of(await answer).shape == (1, 1)
    assert model.started == [leave]


async def test_tighter_deadline_is_served_first_within_a_priority(make: Make) -> None:
    batcher, model, clock = await make(max_batch_size=1, max_queue_delay_ms=0, held=True)
    busy = batcher.enqueue(marked(1.0), after(clock), "busy")
    await model.entered()  # the model runs "busy"; the rest queue behind it
    relaxed = [batcher.enqueue(marked(2.0 + i), after(clock, 5.0), f"relaxed-{i}") for i in (0, 1)]
    urgent = batcher.enqueue(marked(9.0), after(clock, 1.0), "urgent")
    model.open()
    await asyncio.gather(busy, *relaxed, urgent)
    # Earliest deadline first; equal deadlines in arrival order.
    assert model.order([1.0, 2.0, 3.0, 9.0]) == [1.0, 9.0, 2.0, 3.0]


async def test_priority_zero_is_served_before_priority_one(make: Make) -> None:
    batcher, model, clock = await make(max_batch_size=1, max_queue_delay_ms=0, held=True)
    busy = batcher.enqueue(marked(1.0), after(clock), "busy")
    await model.entered()  # the model runs "busy"; both below must wait
    low = batcher.enqueue(marked(2.0), after(clock), "low", priority=1)
    high = batcher.enqueue(marked(3.0), after(clock, 2 * LONG), "high", priority=0)
    model.open()
    await asyncio.gather(busy, low, high)
    # Levels are strict: even a later deadline at level 0 goes before level 1.
    assert model.order([1.0, 2.0, 3.0]) == [1.0, 3.0, 2.0]


async def test_cancelled_request_never_reaches_the_model(make: Make) -> None:
    batcher, model, clock = await make(
        max_batch_size=64, max_queue_delay_ms=1000, dispatch="fixed_window"
    )
    caller = asyncio.create_task(batcher.submit(marked(5.0), after(clock), "gone"))
    assert await clock.parked() == pytest.approx(1.0)  # queued; its batch waits for company
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert batcher.waiting == 0  # withdrawn from the queue, not left for the model
    assert await clock.parked() is None  # nothing left to plan for
    kept = batcher.enqueue(marked(6.0), after(clock), "kept")
    await batcher.close()
    assert array_of(await kept).shape == (1, 1)
    assert model.saw(6.0) and not model.saw(5.0)
    assert batcher.stats.outcomes["cancelled"] == 1


async def test_deadline_blind_batcher_computes_what_its_callers_gave_up_on(make: Make) -> None:
    # The comparison baseline (deadline_policy: ignore) does what Triton's default queue does.
    batcher, model, clock = await make(
        max_batch_size=1, max_queue_delay_ms=0, held=True, deadline_policy="ignore"
    )
    ahead = [batcher.enqueue(marked(i), after(clock), f"ahead-{i}") for i in range(3)]
    await model.entered()
    gone = batcher.enqueue(marked(7.0), after(clock, 0.05), "gone")
    clock.advance_to(0.06)  # its deadline passes in the queue: no timer takes it out
    gone.cancel()  # what gRPC does when the caller's deadline passes
    assert batcher.waiting == 3  # ahead-1, ahead-2 and the abandoned one
    model.open()
    await asyncio.gather(*ahead)
    await batcher.close()
    assert model.saw(7.0)  # computed anyway, after its deadline
    assert batcher.stats.expired_computed == 1
    assert batcher.stats.outcomes["cancelled"] == 1 and batcher.stats.outcomes["ok"] == 3


# --- dispatch policies -------------------------------------------------------------------


async def test_preferred_batch_size_leaves_without_waiting(make: Make) -> None:
    batcher, _, clock = await make(
        max_batch_size=64, max_queue_delay_ms=1000, preferred_batch_sizes=[4]
    )
    answers = [batcher.enqueue(rows(1, i), after(clock), f"r{i}") for i in range(4)]
    await asyncio.gather(*answers)  # answered while the clock stood still
    assert batcher.stats.batch_sizes[4].executions == 1
    assert batcher.stats.queue_wait_hist.sum == 0.0


async def test_preferred_batch_size_is_taken_from_a_longer_queue(make: Make) -> None:
    batcher, model, clock = await make(
        max_batch_size=64,
        max_queue_delay_ms=300,
        preferred_batch_sizes=[4],
        dispatch="fixed_window",
    )
    answers = [batcher.enqueue(rows(1, i), after(clock), f"r{i}") for i in range(6)]
    await asyncio.gather(*answers[:4])  # a preferred batch leaves without waiting
    assert [len(batch) for batch in model.batches] == [4]
    assert await clock.parked() == pytest.approx(0.3)  # the other two wait out the window
    clock.advance_to(0.3)
    await asyncio.gather(*answers[4:])
    assert [len(batch) for batch in model.batches] == [4, 2]


async def test_lone_request_leaves_at_once_under_adaptive_dispatch(make: Make) -> None:
    adaptive, _, clock = await make(max_batch_size=64, max_queue_delay_ms=300)
    for _ in range(3):  # a closed loop of one caller: never company to wait for
        await adaptive.submit(rows(1), after(clock), "alone")  # the clock stands still
        clock.advance(0.01)  # the caller's own time before its next request
    assert not adaptive.overlap.company_expected
    assert adaptive.stats.queue_wait_hist.sum == 0.0
    fixed, _, fixed_clock = await make(
        max_batch_size=64, max_queue_delay_ms=300, dispatch="fixed_window"
    )
    answer = fixed.enqueue(rows(1), after(fixed_clock), "alone")
    assert await fixed_clock.parked() == pytest.approx(0.3)  # Triton's rule: waits the window
    fixed_clock.advance_to(0.3)
    await answer
    assert fixed.stats.queue_wait_hist.sum == pytest.approx(0.3)


async def test_adaptive_dispatch_waits_for_company_once_arrivals_overlap(make: Make) -> None:
    batcher, model, clock = await make(
        max_batch_size=64, max_queue_delay_ms=50, expected_ms={1: 5.0, 64: 10.0}
    )
    # A burst arriving at one instant: each far sooner after the previous than the 5 ms a
    # batch of one takes.
    burst = [batcher.enqueue(rows(1, i), after(clock), f"b{i}") for i in range(20)]
    assert batcher.overlap.company_expected
    assert await clock.parked() == pytest.approx(0.05)  # it waits for company, up to the window
    clock.advance(0.01)
    late_comer = batcher.enqueue(rows(1), after(clock), "late-comer")
    clock.advance_to(0.05)
    await asyncio.gather(*burst, late_comer)
    assert [len(batch) for batch in model.batches] == [21]


def test_arrival_overlap_tells_a_lone_caller_from_overlapping_traffic() -> None:
    solo = 0.0005  # a batch of one takes 0.5 ms
    lone = ArrivalOverlap(solo)
    now = 0.0
    for _ in range(500):  # one caller: its next request comes after our answer (>= solo)
        now += solo + 0.0003
        assert not lone.observe(now)
    busy = ArrivalOverlap(solo)
    rng = np.random.default_rng(1)
    now = 0.0
    for _ in range(500):  # independent callers at 2,000 req/s: many gaps under 0.5 ms
        now += rng.exponential(1 / 2000)
        busy.observe(now)
    assert busy.company_expected and busy.share > 0.4
    for _ in range(500):  # traffic thins out to 50 req/s: back to dispatching at once
        now += rng.exponential(1 / 50)
        busy.observe(now)
    assert not busy.company_expected


# --- failures ----------------------------------------------------------------------------


class PoisonSensitive(torch.nn.Module):
    """Raises on any batch holding a NaN; sums each row otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(torch.isnan(x).any()):
            raise RuntimeError("poisoned row: secret internals")
        return x.sum(dim=1, keepdim=True)


class DropsARow(torch.nn.Module):
    """Answers one row fewer than it was given."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:-1, :1]


async def test_poisoned_request_fails_alone_while_the_rest_of_its_batch_succeeds(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=BATCHER_LOG)
    batcher, model, clock = await make(
        torchscript_artifact(PoisonSensitive()), max_batch_size=8, max_queue_delay_ms=50
    )
    requests = [rows(1, seed=i) for i in range(8)]
    requests[5] = np.full((1, 64), np.nan, dtype=np.float32)
    outcomes = await asyncio.gather(
        *(batcher.submit(r, after(clock), f"r{i}") for i, r in enumerate(requests)),
        return_exceptions=True,
    )
    for index, (request, outcome) in enumerate(zip(requests, outcomes, strict=True)):
        if index == 5:
            assert isinstance(outcome, InferenceFailed)
            assert outcome.code == grpc.StatusCode.INTERNAL
            # TorchScript raises torch.jit.Error; its message (internals) stays in the log.
            assert outcome.message == "inference failed (Error)"
        else:
            np.testing.assert_allclose(
                array_of(outcome), request.sum(axis=1, keepdims=True), rtol=1e-5
            )
    # Halves until only the culprit fails: 8 -> 4 ok, 4 -> 2 -> 1 ok, 1 failed; 2 ok.
    assert [len(batch) for batch in model.batches] == [8, 4, 4, 2, 1, 1, 2]
    assert batcher.stats.outcomes["failed"] == 1 and batcher.stats.outcomes["ok"] == 7
    [record] = [r for r in caplog.records if r.getMessage() == "inference failed"]
    assert vars(record)["request_id"] == "r5" and record.exc_info is not None
    # The replica keeps serving.
    again = await batcher.submit(rows(1), after(clock), "after")
    assert array_of(again).shape == (1, 1)


async def test_model_answering_the_wrong_number_of_rows_fails_every_waiter_with_internal(
    make: Make,
) -> None:
    batcher, _, clock = await make(
        torchscript_artifact(DropsARow()), max_batch_size=4, max_queue_delay_ms=10
    )
    answers = [batcher.enqueue(rows(1, i), after(clock), f"r{i}") for i in range(2)]
    outcomes = await asyncio.gather(*answers, return_exceptions=True)
    assert all(
        isinstance(o, InferenceFailed) and o.message == "inference failed (ValueError)"
        for o in outcomes
    )
    assert len(outcomes) == 2
    assert batcher.stats.outcomes["failed"] == 2


# --- learning what the model costs -------------------------------------------------------


def test_latency_table_learns_and_estimates_unseen_sizes() -> None:
    table = LatencyTable(alpha=0.5, seed={1: 0.001, 8: 0.004})
    assert table.expected(1) == 0.001
    assert table.expected(4) == pytest.approx(0.001 + 0.003 * 3 / 7)
    assert table.expected(16) == pytest.approx(0.008)  # proportional above the largest
    table.observe(1, 0.003)
    assert table.expected(1) == pytest.approx(0.002)
    assert LatencyTable().expected(5) == 0.0


async def test_warm_up_seeds_expected_times_and_the_time_of_a_batch_of_one(
    artifacts: dict[int, Artifact],
) -> None:
    batcher = Batcher(demo_runner(artifacts[1], 8), BatchingSpec(max_batch_size=8))
    try:
        timings = await batcher.warm_up([1, 8])
    finally:
        await batcher.close()
    assert sorted(timings) == [1, 8] and all(seconds > 0 for seconds in timings.values())
    assert batcher.latency.snapshot() == timings
    assert batcher.overlap.solo_s == timings[1]


async def test_every_model_call_is_measured_on_the_batchers_clock(make: Make) -> None:
    batcher, model, clock = await make(
        max_batch_size=1, max_queue_delay_ms=0, held=True, expected_ms={1: 10.0}
    )
    answer = batcher.enqueue(rows(1), after(clock), "measured")
    await model.entered()
    clock.advance(0.03)  # the forward pass "takes" 30 ms
    model.release()
    await answer
    # EWMA (alpha 0.2) from the 10 ms seed towards the 30 ms measured.
    assert batcher.latency.expected(1) == pytest.approx(0.014)
    assert batcher.stats.compute_hist.sum == pytest.approx(0.03)
    assert batcher.stats.success.ns == pytest.approx(30_000_000, abs=1)


async def test_histograms_count_model_calls_rows_and_waits(make: Make) -> None:
    batcher, model, clock = await make(
        max_batch_size=8, max_queue_delay_ms=20, dispatch="fixed_window"
    )
    answers = [batcher.enqueue(rows(2, i), after(clock), f"r{i}") for i in range(10)]
    await asyncio.gather(*answers[:8])  # two full batches of 8 rows leave at once
    assert await clock.parked() == pytest.approx(0.02)  # the last 4 rows wait the window
    clock.advance_to(0.02)
    await asyncio.gather(*answers[8:])
    stats = batcher.stats
    assert [len(batch) for batch in model.batches] == [8, 8, 4]
    assert stats.batch_size_hist.count == stats.executions == 3
    assert stats.batch_size_hist.sum == stats.inference_count == 20
    assert sum(stats.batch_size_hist.counts) == stats.executions
    assert stats.queue_wait_hist.count == 10 and stats.compute_hist.count == stats.executions
    assert stats.queue_wait_hist.sum == pytest.approx(2 * 0.02)  # only the last two waited
