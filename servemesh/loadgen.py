"""Open-loop Predict load: requests leave on a fixed schedule, whether or not earlier ones
have answered, so a stall shows up as latency and errors instead of hiding as a lower rate
(no coordinated omission). Used by tests, benchmarks and drills.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class Outcome:
    sent_s: float  # seconds since the run started
    latency_ms: float
    code: str  # "OK" or the gRPC status name
    version: str = ""
    replica: str = ""
    zone: str = ""
    degraded: bool = False


@dataclass(frozen=True)
class Event:
    """Something to do while the load runs (kill a replica, change weights), at `at_s`."""

    at_s: float
    action: Callable[[], Any]
    name: str = ""


@dataclass
class EventRecord:
    name: str
    started_s: float
    finished_s: float
    result: Any = None
    error: str = ""


@dataclass
class LoadRun:
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[EventRecord] = field(default_factory=list)

    def window(self, start_s: float, end_s: float = float("inf")) -> list[Outcome]:
        """Outcomes of requests sent in [start_s, end_s)."""
        return [o for o in self.outcomes if start_s <= o.sent_s < end_s]

    def event(self, name: str) -> EventRecord:
        return next(e for e in self.events if e.name == name)


def success_rate(outcomes: Sequence[Outcome]) -> float:
    return sum(o.code == "OK" for o in outcomes) / len(outcomes) if outcomes else float("nan")


def share(outcomes: Sequence[Outcome], key: Callable[[Outcome], bool]) -> float:
    ok = [o for o in outcomes if o.code == "OK"]
    return sum(key(o) for o in ok) / len(ok) if ok else float("nan")


async def predict_once(
    stub: gateway_pb2_grpc.GatewayStub,
    *,
    model: str,
    entity: str,
    sent_s: float,
    timeout_s: float,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> Outcome:
    """One Predict, its outcome and latency (never raises for a gRPC error)."""
    request = gateway_pb2.PredictRequest(model=model, entity_ids=[entity])
    t0 = time.perf_counter()
    try:
        reply = await stub.Predict(request, timeout=timeout_s, metadata=metadata or None)
    except grpc.aio.AioRpcError as exc:
        return Outcome(sent_s, (time.perf_counter() - t0) * 1000, exc.code().name)
    return Outcome(
        sent_s,
        (time.perf_counter() - t0) * 1000,
        "OK",
        reply.model_version,
        reply.model_replica,
        reply.model_zone,
        reply.degraded,
    )


async def open_loop(
    address: str,
    *,
    rate_per_s: float,
    duration_s: float,
    model: str = "fraud",
    entities: int = 100,
    timeout_s: float = 2.0,
    events: Sequence[Event] = (),
) -> LoadRun:
    """Send Predict at `rate_per_s` for `duration_s`; run `events` (in a thread) on time."""
    run = LoadRun()
    loop = asyncio.get_running_loop()
    started = time.perf_counter()

    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def one(index: int, sent_s: float) -> None:
            entity = f"user-{index % entities}"
            outcome = await predict_once(
                stub, model=model, entity=entity, sent_s=sent_s, timeout_s=timeout_s
            )
            run.outcomes.append(outcome)

        def run_event(event: Event) -> None:
            record = EventRecord(event.name, time.perf_counter() - started, 0.0)
            try:
                record.result = event.action()
            except Exception as exc:  # recorded for the caller to assert on
                record.error = f"{type(exc).__name__}: {exc}"
            record.finished_s = time.perf_counter() - started
            run.events.append(record)

        async def at_time(event: Event) -> None:
            await asyncio.sleep(max(0.0, started + event.at_s - time.perf_counter()))
            await loop.run_in_executor(None, run_event, event)

        tasks: list[asyncio.Task[None]] = [asyncio.create_task(at_time(e)) for e in events]
        interval = 1.0 / rate_per_s
        for index in range(int(duration_s * rate_per_s)):
            delay = started + index * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, time.perf_counter() - started)))
        await asyncio.gather(*tasks)
    run.outcomes.sort(key=lambda o: o.sent_s)
    return run
