"""Load generators for OIP ModelInfer: closed loop, open loop, and a deadline mix.

The client is kept lean so that it is not what the numbers measure: requests are serialised
once up front and sent as bytes through a generic unary-unary call, and answers come back
as bytes that are never parsed (the status alone says whether a call succeeded). Each
result records the client's own CPU time, so a reader can see how close it came to its
core.

Open-loop latencies are measured from each request's scheduled send time, not from when
the client got round to sending it: a stalled server cannot hide its tail by slowing the
client down (coordinated omission).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from servemesh.demo import N_FEATURES
from servemesh.wire import MODEL_INFER_METHOD, message_size_options
from servemesh_api.inference import grpc_service_pb2 as oip

METHOD = MODEL_INFER_METHOD
CHANNEL_OPTIONS = message_size_options(4 * 1024 * 1024)


def request_bodies(model: str, count: int = 256, rows: int = 1, seed: int = 0) -> list[bytes]:
    """`count` serialised ModelInfer requests, `rows` random feature rows each (raw FP32)."""
    rng = np.random.default_rng(seed)
    bodies = []
    for index in range(count):
        request = oip.ModelInferRequest(model_name=model, id=str(index))
        request.inputs.add(name="features", datatype="FP32", shape=[rows, N_FEATURES])
        request.raw_input_contents.append(
            rng.normal(size=(rows, N_FEATURES)).astype("<f4").tobytes()
        )
        bodies.append(request.SerializeToString())
    return bodies


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


@dataclass
class LoadResult:
    """One measurement; latencies in ms, `ok` answers over `seconds` of measured time."""

    mode: str  # closed, open, deadline-mix
    concurrency: int = 0
    rate: float = 0.0  # offered req/s (open loops)
    seconds: float = 0.0
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    client_cpu: float = 0.0  # share of one core the client used while measuring
    # Deadline mix: OK answers of the short-deadline callers, and how many were sent.
    short_ok: int = 0
    short_sent: int = 0

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, object]:
        ordered = sorted(self.latencies_ms)
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "seconds": round(self.seconds, 3),
            "sent": self.sent,
            "ok": self.ok,
            "rps": round(self.rps, 1),
            "p50_ms": round(percentile(ordered, 0.50), 3),
            "p95_ms": round(percentile(ordered, 0.95), 3),
            "p99_ms": round(percentile(ordered, 0.99), 3),
            "errors": dict(self.errors),
            "error_count": sum(self.errors.values()),
            "client_cpu": round(self.client_cpu, 3),
            "short_ok": self.short_ok,
            "short_sent": self.short_sent,
        }


# Called with True when the measured window opens and False when it closes (the bench
# snapshots the server's CPU time and metrics there).
WindowHook = Callable[[bool], None]


class _Meter:
    """Counts outcomes and CPU between start() and stop()."""

    def __init__(self, result: LoadResult, hook: WindowHook | None) -> None:
        self.result = result
        self.hook = hook
        self.recording = False
        self.errors: collections.Counter[str] = collections.Counter()
        self._wall = self._cpu = 0.0

    def start(self) -> None:
        if self.hook:
            self.hook(True)
        self.recording = True
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        self.recording = False
        wall = time.perf_counter() - self._wall
        cpu = time.process_time() - self._cpu
        if self.hook:
            self.hook(False)
        self.result.seconds = wall
        self.result.client_cpu = cpu / wall if wall else 0.0
        self.result.errors = dict(self.errors)


async def closed_loop(
    address: str,
    bodies: list[bytes],
    concurrency: int,
    seconds: float,
    warmup_s: float = 1.0,
    timeout_s: float = 5.0,
    hook: WindowHook | None = None,
) -> LoadResult:
    """`concurrency` callers, each sending its next request as soon as the last returns."""
    result = LoadResult(mode="closed", concurrency=concurrency)
    meter = _Meter(result, hook)
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(METHOD)
        stop_at = 0.0

        async def caller(offset: int) -> None:
            index = offset
            while time.perf_counter() < stop_at:
                body = bodies[index % len(bodies)]
                index += concurrency
                started = time.perf_counter()
                try:
                    await call(body, timeout=timeout_s)
                except grpc.aio.AioRpcError as exc:
                    if meter.recording:
                        meter.errors[exc.code().name] += 1
                    continue
                if meter.recording:
                    result.ok += 1
                    result.latencies_ms.append((time.perf_counter() - started) * 1000)

        # The callers keep running from warm-up into the measurement: no ramp-up dip.
        stop_at = time.perf_counter() + warmup_s + seconds
        tasks = [asyncio.ensure_future(caller(i)) for i in range(concurrency)]
        await asyncio.sleep(warmup_s)
        meter.start()
        await asyncio.sleep(seconds)
        meter.stop()
        result.sent = result.ok + sum(meter.errors.values())
        await asyncio.gather(*tasks)
    return result


async def open_loop(
    address: str,
    bodies: list[bytes],
    rate: float,
    seconds: float,
    warmup_s: float = 1.0,
    timeout_for: Callable[[int], float] | None = None,
    is_short: Callable[[int], bool] | None = None,
    max_outstanding: int = 8192,
    hook: WindowHook | None = None,
) -> LoadResult:
    """Requests sent on a fixed schedule (`rate` per second) whatever the answers do.

    `timeout_for(i)` gives request i its deadline (default 1 s); `is_short(i)` marks the
    requests counted separately as short-deadline callers (the deadline mix).
    """
    result = LoadResult(mode="deadline-mix" if is_short else "open", rate=rate)
    meter = _Meter(result, hook)
    timeout_for = timeout_for or (lambda index: 1.0)
    outstanding = 0
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(METHOD)

        async def one(index: int, scheduled: float, recorded: bool) -> None:
            nonlocal outstanding
            short = is_short(index) if is_short else False
            try:
                await call(bodies[index % len(bodies)], timeout=timeout_for(index))
            except grpc.aio.AioRpcError as exc:
                if recorded:
                    meter.errors[exc.code().name] += 1
            else:
                if recorded:
                    result.ok += 1
                    result.short_ok += short
                    result.latencies_ms.append((time.perf_counter() - scheduled) * 1000)
            finally:
                outstanding -= 1

        interval = 1.0 / rate
        started = time.perf_counter()
        measure_from = started + warmup_s
        measure_to = measure_from + seconds
        tasks: set[asyncio.Future[None]] = set()
        index = 0
        measuring = False
        while True:
            now = time.perf_counter()
            if not measuring and now >= measure_from:
                meter.start()
                measuring = True
            if now >= measure_to:
                meter.stop()
                break
            # Send everything now due (timers fire late; the schedule does not slip).
            while started + index * interval <= now:
                scheduled = started + index * interval
                recorded = measure_from <= scheduled < measure_to
                if recorded:
                    result.sent += 1
                    result.short_sent += is_short(index) if is_short else 0
                if outstanding >= max_outstanding:
                    if recorded:
                        meter.errors["CLIENT_OVERLOADED"] += 1
                else:
                    outstanding += 1
                    task = asyncio.ensure_future(one(index, scheduled, recorded))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                index += 1
            await asyncio.sleep(max(0.0, started + index * interval - time.perf_counter()))
        # Answers to requests sent in the window count: wait for them. Rates are over the
        # sending window (what was offered), CPU shares over the same window.
        if tasks:
            await asyncio.wait(tasks)
        result.errors = dict(meter.errors)
        result.seconds = seconds
    return result
