"""A through-mesh batch run's window: full while its calls answer at their base latency,
smaller while they slow down (online traffic needs the mesh), full again once they recover.
Driven by an injected clock and latencies: no network, no sleeps as sync."""

from __future__ import annotations

import asyncio

import pytest

from servemesh.batch.yielding import (
    BASE_BUCKET_S,
    BASE_BUCKETS,
    MIN_WINDOW,
    YieldingGate,
    YieldingWindow,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def answer(window: YieldingWindow, clock: Clock, latency_s: float, times: int = 1) -> None:
    for _ in range(times):
        clock.now += latency_s
        window.answered(latency_s)


def test_an_idle_mesh_keeps_the_whole_window() -> None:
    clock = Clock()
    window = YieldingWindow(4, clock)
    answer(window, clock, 0.010, 200)
    assert window.window == 4.0
    assert window.in_flight == 4
    assert window.gap_s(0.010) == 0.0


def test_slower_calls_shrink_the_window_to_its_floor_and_pause_between_calls() -> None:
    clock = Clock()
    window = YieldingWindow(4, clock)
    answer(window, clock, 0.010, 20)
    answer(window, clock, 0.050, 200)  # 40 ms over a 10 ms base: far over the target
    assert window.window == MIN_WINDOW
    assert window.in_flight == 1
    # One call in flight a tenth of the time: a 50 ms call is followed by 450 ms of pause.
    assert window.gap_s(0.050) == pytest.approx(0.450)


def test_a_delay_just_over_the_target_shrinks_the_window_gently() -> None:
    clock = Clock()
    window = YieldingWindow(4, clock)
    answer(window, clock, 0.010, 20)
    answer(window, clock, 0.025, 1)  # 15 ms queueing against a 10 ms target: not halved
    assert 3.5 < window.window < 4.0


def test_the_window_grows_back_when_the_calls_recover() -> None:
    clock = Clock()
    window = YieldingWindow(4, clock)
    answer(window, clock, 0.010, 20)
    answer(window, clock, 0.050, 200)
    assert window.window == MIN_WINDOW
    answer(window, clock, 0.010, 40)
    assert window.window == 4.0


def test_the_window_halves_once_per_round_trip_not_once_per_answer() -> None:
    clock = Clock()
    window = YieldingWindow(4, clock)
    answer(window, clock, 0.010, 20)
    # Four answers of one round trip come back together: one halving, not four.
    for _ in range(4):
        window.answered(0.050)
    assert window.window == 2.0


def test_a_refusal_for_load_halves_the_window() -> None:
    clock = Clock()
    window = YieldingWindow(4, clock)
    answer(window, clock, 0.010, 5)
    window.refused()
    assert window.window == 2.0


def test_the_base_follows_a_mesh_that_stays_slower() -> None:
    clock = Clock()
    window = YieldingWindow(4, clock)
    answer(window, clock, 0.010, 10)
    assert window.base_s == 0.010
    # Slower for longer than the base's memory (a replica gone for good): the new latency
    # becomes the base, and the run takes its whole window again.
    seconds = BASE_BUCKET_S * (BASE_BUCKETS + 1)
    answer(window, clock, 0.030, int(seconds / 0.030) + 1)
    assert window.base_s == 0.030
    assert window.window == 4.0


def test_a_greedy_window_never_moves() -> None:
    clock = Clock()
    window = YieldingWindow(4, clock, fixed=True)
    answer(window, clock, 0.010, 20)
    answer(window, clock, 0.500, 20)
    window.refused()
    assert window.window == 4.0


def test_the_gate_lets_out_no_more_than_the_window() -> None:
    async def run() -> int:
        window = YieldingWindow(3)
        gate = YieldingGate(window)
        out = 0
        most = 0
        release = asyncio.Event()

        async def call() -> None:
            nonlocal out, most
            async with gate.slot():
                out += 1
                most = max(most, out)
                await release.wait()
                out -= 1

        calls = [asyncio.ensure_future(call()) for _ in range(8)]
        while out < 3:
            await asyncio.sleep(0)
        for _ in range(20):  # the others had every chance to enter
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*calls)
        return most

    assert asyncio.run(run()) == 3


def test_the_gate_frees_the_slot_of_a_failed_call() -> None:
    async def run() -> float:
        window = YieldingWindow(1)
        gate = YieldingGate(window)
        with pytest.raises(RuntimeError):
            async with gate.slot():
                raise RuntimeError("refused")
        async with gate.slot():  # would wait forever if the slot were still held
            pass
        return window.window

    assert asyncio.run(run()) == 1.0
