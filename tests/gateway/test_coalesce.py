"""The coalescer's rules, with no network: who shares a call, when it leaves, which deadline
it carries, and that every member hears back. The clock is injected; calls are futures the
test settles, so nothing sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from servemesh.services.gateway.coalesce import Coalescer, Member, settle
from servemesh.services.runtime.errors import DeadlineExceeded, Internal

T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Downstream:
    """A send that records each call and answers it when the test says."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[Member[str, str]]]] = []
        self.replies: list[asyncio.Future[None]] = []
        self.arrived = asyncio.Event()

    async def send(self, key: str, members: list[Member[str, str]]) -> None:
        self.calls.append((key, list(members)))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.replies.append(done)
        self.arrived.set()
        await done
        for member in members:
            settle(member, f"{member.item}@{len(self.calls)}")

    def answer(self, index: int) -> None:
        self.replies[index].set_result(None)

    async def wait_calls(self, count: int) -> None:
        while len(self.calls) < count:
            self.arrived.clear()
            await self.arrived.wait()


async def settled(*futures: Awaitable[T]) -> list[T | BaseException]:
    return await asyncio.gather(*futures, return_exceptions=True)


def _start(
    coalescer: Coalescer[str, str, str],
    key: str,
    item: str,
    *,
    rows: int = 1,
    deadline: float = 200.0,
    max_rows: int = 64,
) -> asyncio.Task[str]:
    return asyncio.get_running_loop().create_task(
        coalescer.submit(key, item, rows, deadline, max_rows)
    )


async def test_a_lone_request_leaves_at_once_and_alone() -> None:
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=Clock())
    task = _start(coalescer, "m", "a")
    await down.wait_calls(1)
    assert [m.item for m in down.calls[0][1]] == ["a"]
    down.answer(0)
    assert await task == "a@1"


async def test_requests_arriving_together_share_one_call() -> None:
    down = Downstream()
    sizes: list[int] = []
    coalescer: Coalescer[str, str, str] = Coalescer(
        down.send, clock=Clock(), on_call=lambda _key, n: sizes.append(n)
    )
    tasks = [_start(coalescer, "m", item) for item in "abc"]
    await down.wait_calls(1)
    down.answer(0)
    assert await settled(*tasks) == ["a@1", "b@1", "c@1"]
    assert sizes == [3]


async def test_requests_behind_a_call_in_flight_wait_for_it_then_leave_together() -> None:
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=Clock())
    first = _start(coalescer, "m", "a")
    await down.wait_calls(1)
    behind = [_start(coalescer, "m", item) for item in "bcd"]
    await asyncio.sleep(0)  # let them queue (a loop turn, not a wait for time)
    assert len(down.calls) == 1 and coalescer.pending("m") == 3
    down.answer(0)
    await down.wait_calls(2)
    assert [m.item for m in down.calls[1][1]] == ["b", "c", "d"]
    down.answer(1)
    assert await first == "a@1"
    assert await settled(*behind) == ["b@2", "c@2", "d@2"]


async def test_waiting_counts_the_members_queued_under_every_key() -> None:
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=Clock())
    firsts = [_start(coalescer, "m", "a"), _start(coalescer, "n", "b")]
    await down.wait_calls(2)
    assert coalescer.waiting() == 0, "both left alone: nothing queued"
    behind = [_start(coalescer, key, item) for key, item in [("m", "c"), ("m", "d"), ("n", "e")]]
    await asyncio.sleep(0)  # let them queue (a loop turn, not a wait for time)
    assert coalescer.waiting() == 3
    down.answer(0)
    await down.wait_calls(3)
    assert coalescer.waiting() == 1, "m's two left; n's one waits for n's call"
    down.answer(1)
    await down.wait_calls(4)
    assert coalescer.waiting() == 0
    down.answer(2)
    down.answer(3)
    await settled(*firsts, *behind)


async def test_alone_makes_the_call_at_once_past_the_queue_and_uncounted() -> None:
    down = Downstream()
    sizes: list[int] = []
    coalescer: Coalescer[str, str, str] = Coalescer(
        down.send, clock=Clock(), on_call=lambda _key, n: sizes.append(n)
    )
    first = _start(coalescer, "m", "a")
    await down.wait_calls(1)
    # A call of m is in flight: a shared member would wait for it; a lone one does not.
    lone = asyncio.get_running_loop().create_task(coalescer.alone("m", "b", 1, 200.0))
    await down.wait_calls(2)
    assert [m.item for m in down.calls[1][1]] == ["b"] and coalescer.waiting() == 0
    down.answer(1)
    assert await lone == "b@2"
    down.answer(0)
    assert await first == "a@2"
    assert sizes == [1], "only the shared call was counted"


async def test_alone_fails_as_internal_when_send_leaves_its_member_unanswered() -> None:
    async def forgetful(_key: str, _members: list[Member[str, str]]) -> None:
        return None

    coalescer: Coalescer[str, str, str] = Coalescer(forgetful, clock=Clock())
    with pytest.raises(Internal, match="unanswered"):
        await coalescer.alone("m", "a", 1, 200.0)


async def test_other_keys_never_share_and_never_wait() -> None:
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=Clock())
    one = _start(coalescer, "v1", "a")
    await down.wait_calls(1)
    two = _start(coalescer, "v2", "b")  # v1's call is in flight: v2 does not wait for it
    await down.wait_calls(2)
    assert [(key, [m.item for m in ms]) for key, ms in down.calls] == [
        ("v1", ["a"]),
        ("v2", ["b"]),
    ]
    down.answer(1)
    assert await two == "b@2"
    down.answer(0)
    assert await one == "a@2"  # answered after the second call: the counter says 2


async def test_a_full_batch_leaves_without_waiting_for_the_call_in_flight() -> None:
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=Clock())
    first = _start(coalescer, "m", "a", max_rows=4)
    await down.wait_calls(1)
    rest = [_start(coalescer, "m", item, rows=2, max_rows=4) for item in "bc"]
    await down.wait_calls(2)  # 4 rows queued: the cap, so it left beside the first
    assert [m.item for m in down.calls[1][1]] == ["b", "c"]
    down.answer(0)
    down.answer(1)
    assert await first == "a@2"
    assert await settled(*rest) == ["b@2", "c@2"]


async def test_a_request_larger_than_the_cap_goes_alone() -> None:
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=Clock())
    tasks = [
        _start(coalescer, "m", "big", rows=10, max_rows=4),
        _start(coalescer, "m", "small", rows=1, max_rows=4),
    ]
    await down.wait_calls(1)
    assert [m.item for m in down.calls[0][1]] == ["big"]
    down.answer(0)
    await down.wait_calls(2)  # the small one waited for the big one's call, then left
    assert [m.item for m in down.calls[1][1]] == ["small"]
    down.answer(1)
    assert await settled(*tasks) == ["big@1", "small@2"]


async def test_a_call_carries_the_earliest_deadline_of_its_members() -> None:
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=Clock())
    tasks = [
        _start(coalescer, "m", "late", deadline=150.0),
        _start(coalescer, "m", "soon", deadline=120.0),
    ]
    await down.wait_calls(1)
    assert min(m.deadline for m in down.calls[0][1]) == 120.0
    down.answer(0)
    await settled(*tasks)


async def test_a_request_whose_deadline_passed_is_refused_before_it_joins() -> None:
    clock = Clock()
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=clock)
    with pytest.raises(DeadlineExceeded):
        await coalescer.submit("m", "a", 1, clock.now - 0.001, 64)
    assert down.calls == []


async def test_a_member_that_expires_while_waiting_fails_alone_and_holds_nobody() -> None:
    clock = Clock()
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=clock)
    first = _start(coalescer, "m", "a")
    await down.wait_calls(1)
    short = _start(coalescer, "m", "short", deadline=clock.now + 0.010)
    long = _start(coalescer, "m", "long")
    await asyncio.sleep(0)
    # The call in flight outlives the short deadline: the member is failed when it passes
    # (its timer is on the loop's clock), the others are not held by it.
    clock.now += 1.0
    with pytest.raises(DeadlineExceeded):
        await short
    down.answer(0)
    await down.wait_calls(2)
    assert [m.item for m in down.calls[1][1]] == ["long"]
    down.answer(1)
    assert await first == "a@1"
    assert await long == "long@2"


async def test_a_member_expired_when_its_call_leaves_is_failed_and_left_out() -> None:
    clock = Clock()
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=clock)
    first = _start(coalescer, "m", "a")
    await down.wait_calls(1)
    short = _start(coalescer, "m", "short", deadline=clock.now + 5.0)
    long = _start(coalescer, "m", "long", deadline=clock.now + 50.0)
    await asyncio.sleep(0)
    clock.now += 10.0  # past the short deadline, before its timer could fire
    down.answer(0)
    await down.wait_calls(2)
    assert [m.item for m in down.calls[1][1]] == ["long"]
    with pytest.raises(DeadlineExceeded):
        await short
    down.answer(1)
    assert await first == "a@1" and await long == "long@2"


async def test_a_caller_that_gives_up_is_left_out_of_the_next_call() -> None:
    down = Downstream()
    coalescer: Coalescer[str, str, str] = Coalescer(down.send, clock=Clock())
    first = _start(coalescer, "m", "a")
    await down.wait_calls(1)
    quitter = _start(coalescer, "m", "quitter")
    stayer = _start(coalescer, "m", "stayer")
    await asyncio.sleep(0)
    quitter.cancel()
    down.answer(0)
    await down.wait_calls(2)
    assert [m.item for m in down.calls[1][1]] == ["stayer"]
    down.answer(1)
    assert await first == "a@1" and await stayer == "stayer@2"


async def test_a_send_that_forgets_or_breaks_still_answers_every_member() -> None:
    async def forgetful(key: str, members: list[Member[str, str]]) -> None:
        settle(members[0], "answered")

    coalescer: Coalescer[str, str, str] = Coalescer(forgetful, clock=Clock())
    results = await settled(*(_start(coalescer, "m", item) for item in "ab"))
    assert results[0] == "answered" and isinstance(results[1], Internal)

    async def broken(key: str, members: list[Member[str, str]]) -> None:
        raise RuntimeError("a bug")

    coalescer = Coalescer(broken, clock=Clock())
    results = await settled(*(_start(coalescer, "m", item) for item in "ab"))
    assert all(isinstance(r, Internal) for r in results)
    # And the key is free again: the next request is sent, not stuck behind a dead call.
    later = await settled(_start(coalescer, "m", "c"))
    assert isinstance(later[0], Internal)
