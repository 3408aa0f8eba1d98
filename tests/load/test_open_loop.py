"""servemesh.load's open loop against a real gRPC server on loopback: requests leave on
schedule whatever the server does, and latency counts from when each one was due."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from servemesh.load import (
    BackgroundLoad,
    FixedRate,
    LoadRun,
    Target,
    open_loop,
    raw_target,
    summarize,
)

METHOD = "/servemesh.test.Echo/Echo"
RATE = 100.0  # request i is due at i * 10 ms


class Echo:
    """Answers each request with its body (the request's index, as text). Requests below
    `hold_below` wait for `release`, which the arrival of request `release_at` sets."""

    def __init__(self) -> None:
        self.hold_below = 0
        self.release_at = -1
        self.release = asyncio.Event()
        self.arrived: list[int] = []
        self.arrived_before_release: list[int] = []
        self.seen_enough = asyncio.Event()
        self.enough = 0

    async def answer(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        index = int(body)
        self.arrived.append(index)
        if self.enough and len(self.arrived) >= self.enough:
            self.seen_enough.set()
        if index == self.release_at:
            self.arrived_before_release = list(self.arrived)
            self.release.set()
        if index < self.hold_below:
            await self.release.wait()
        return body


@pytest.fixture
async def echo() -> AsyncIterator[tuple[Echo, str]]:
    handler = Echo()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "servemesh.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(handler.answer)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield handler, f"127.0.0.1:{port}"
    await server.stop(grace=None)


def target(address: str, count: int) -> Target:
    # Deadlines far beyond the test: a call that never came back fails an assertion, it
    # does not hang the test.
    bodies = [str(i).encode() for i in range(count)]
    return raw_target(address, METHOD, bodies, timeout_for=lambda index: 10.0)


async def test_a_server_stall_shows_as_latency_of_the_calls_due_during_it(
    echo: tuple[Echo, str],
) -> None:
    server, address = echo
    server.hold_below, server.release_at = 5, 15  # 0-4 wait until request 15 arrives
    schedule = FixedRate(RATE, duration_s=0.3)
    run = await open_loop(target(address, 30), schedule)

    by_index = {o.index: o for o in run.outcomes}
    assert sorted(by_index) == list(range(30)) and all(o.ok for o in run.outcomes)
    # The stall did not slow the sender: 5 to 15 left while 0 to 4 were unanswered.
    assert set(range(5, 16)) <= set(server.arrived_before_release)
    for index, outcome in by_index.items():
        assert outcome.sent_s == pytest.approx(schedule.due_s(index), abs=1e-9)  # its due time
        assert outcome.latency_ms >= outcome.lag_ms >= 0
    # Request 15 cannot arrive before it is due (150 ms), so each held request waited at
    # least from its own due time until then, and that wait is in its latency.
    for index in range(5):
        stall_ms = (schedule.due_s(15) - schedule.due_s(index)) * 1000
        assert by_index[index].latency_ms >= stall_ms, (index, by_index[index])


async def test_a_client_behind_its_schedule_reports_the_lateness_as_latency_and_lag(
    echo: tuple[Echo, str],
) -> None:
    _, address = echo
    # A client whose time zero was 200 ms ago, as after a 200 ms stall of its own: the
    # first 21 requests are overdue before the first one leaves.
    behind_s = 0.2
    run = LoadRun(origin=time.perf_counter() - behind_s)
    schedule = FixedRate(RATE, duration_s=0.3)
    await open_loop(target(address, 30), schedule, run=run)

    by_index = {o.index: o for o in run.outcomes}
    assert sorted(by_index) == list(range(30)) and all(o.ok for o in run.outcomes)
    for index in range(21):
        late_ms = (behind_s - schedule.due_s(index)) * 1000
        # The server answers at once; the time the request waited for its client to send
        # it is still the caller's time: in the latency, and shown as send lag.
        assert by_index[index].lag_ms >= late_ms
        assert by_index[index].latency_ms >= by_index[index].lag_ms
    overdue = summarize([by_index[i] for i in range(21)], seconds=0.21)
    assert overdue.send_lag_p99_ms >= 190 and overdue.p50_ms >= 100


async def test_a_background_load_is_readable_while_it_runs_and_stops_clean(
    echo: tuple[Echo, str],
) -> None:
    server, address = echo
    server.enough = 20
    load = BackgroundLoad(target(address, 10_000), rate_per_s=200, drain_s=5)
    load.start()
    try:
        await asyncio.wait_for(server.seen_enough.wait(), timeout=30)
        assert load.running
        live = load.last(60.0)
        assert live.sent >= 1 and live.ok == live.sent - live.failed
    finally:
        await asyncio.to_thread(load.stop)  # this loop serves the calls still in flight
    assert not load.running and load.error == ""
    outcomes = load.snapshot()
    assert len(outcomes) == load.sent >= 20
    assert [o.index for o in outcomes] == list(range(len(outcomes)))
    assert all(o.ok for o in outcomes)
    assert [o.sent_s for o in outcomes] == pytest.approx([o.index / 200 for o in outcomes])
