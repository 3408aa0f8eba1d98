"""`servemesh bench model`'s loads: OIP ModelInfer through servemesh.load, closed loop, open
loop, and a deadline mix, each measured over a window after a warm-up.

The client is kept lean so that it is not what the numbers measure: requests are serialised
once up front and sent as bytes through a generic unary-unary call, and answers come back
as bytes that are never parsed (the status alone says whether a call succeeded). Each
result records the client's own CPU time and how late its sends left, so a reader can see
how close it came to its core.

Open-loop latencies are measured from each request's scheduled send time, not from when
the client got round to sending it (servemesh.load): a stalled server cannot hide its tail
by slowing the client down (coordinated omission).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from servemesh import load
from servemesh.contract.demo import N_FEATURES
from servemesh.contract.wire import MODEL_INFER_METHOD, message_size_options
from servemesh.load import (
    ClosedLoop,
    Event,
    FixedRate,
    LoadRun,
    percentile,
    raw_target,
    summarize,
)
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


@dataclass
class LoadResult:
    """One measurement; latencies in ms, `ok` answers to requests sent in the `seconds` of
    measured time."""

    mode: str  # closed, open, deadline-mix
    concurrency: int = 0
    rate: float = 0.0  # offered req/s (open loops)
    seconds: float = 0.0
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    send_lag_p99_ms: float = 0.0  # how late the client's sends left (open loops)
    client_cpu: float = 0.0  # share of one core the client used while measuring
    # Deadline mix: OK answers of the short-deadline callers, and how many were sent.
    short_ok: int = 0
    short_sent: int = 0

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "seconds": round(self.seconds, 3),
            "sent": self.sent,
            "ok": self.ok,
            "rps": round(self.rps, 1),
            "p50_ms": round(percentile(self.latencies_ms, 50), 3),
            "p95_ms": round(percentile(self.latencies_ms, 95), 3),
            "p99_ms": round(percentile(self.latencies_ms, 99), 3),
            "send_lag_p99_ms": round(self.send_lag_p99_ms, 3),
            "errors": dict(self.errors),
            "error_count": sum(self.errors.values()),
            "client_cpu": round(self.client_cpu, 3),
            "short_ok": self.short_ok,
            "short_sent": self.short_sent,
        }


# Called with True when the measured window opens and False when it closes (the bench
# snapshots the server's CPU time and metrics there).
WindowHook = Callable[[bool], None]


class _Window:
    """The measured window's edges, as two events of the run: the client's CPU time between
    them, and the caller's hook at each."""

    def __init__(self, warmup_s: float, seconds: float, hook: WindowHook | None) -> None:
        self.hook = hook
        self.client_cpu = 0.0
        self._wall = self._cpu = 0.0
        self.events = [
            Event(warmup_s, self._open, "window opens"),
            Event(warmup_s + seconds, self._close, "window closes"),
        ]

    def _open(self) -> None:
        if self.hook:
            self.hook(True)
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def _close(self) -> None:
        wall = time.perf_counter() - self._wall
        cpu = time.process_time() - self._cpu
        if self.hook:
            self.hook(False)
        self.client_cpu = cpu / wall if wall > 0 else 0.0


def _result(
    mode: str,
    run: LoadRun,
    warmup_s: float,
    seconds: float,
    window: _Window,
    is_short: Callable[[int], bool] | None = None,
) -> LoadResult:
    """The requests due in the measured window (answers that come after it still count)."""
    measured = run.window(warmup_s, warmup_s + seconds)
    summary = summarize(measured, seconds)
    shorts = [o for o in measured if is_short(o.index)] if is_short else []
    return LoadResult(
        mode=mode,
        seconds=seconds,
        sent=summary.count,
        ok=summary.ok,
        errors=summary.errors,
        latencies_ms=[o.latency_ms for o in measured if o.ok],
        send_lag_p99_ms=summary.send_lag_p99_ms,
        client_cpu=window.client_cpu,
        short_ok=sum(o.ok for o in shorts),
        short_sent=len(shorts),
    )


async def closed_loop(
    address: str,
    bodies: list[bytes],
    concurrency: int,
    seconds: float,
    warmup_s: float = 1.0,
    timeout_s: float = 5.0,
    hook: WindowHook | None = None,
) -> LoadResult:
    """`concurrency` callers, each sending its next request as soon as the last returns;
    they run on from the warm-up into the measurement (no ramp-up dip)."""
    target = raw_target(
        address, METHOD, bodies, timeout_for=lambda index: timeout_s, options=CHANNEL_OPTIONS
    )
    window = _Window(warmup_s, seconds, hook)
    run = await load.closed_loop(
        target, ClosedLoop(concurrency, warmup_s + seconds), events=window.events
    )
    result = _result("closed", run, warmup_s, seconds, window)
    result.concurrency = concurrency
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
    target = raw_target(
        address,
        METHOD,
        bodies,
        timeout_for=timeout_for or (lambda index: 1.0),
        options=CHANNEL_OPTIONS,
    )
    window = _Window(warmup_s, seconds, hook)
    run = await load.open_loop(
        target,
        FixedRate(rate, warmup_s + seconds),
        events=window.events,
        max_outstanding=max_outstanding,
    )
    mode = "deadline-mix" if is_short else "open"
    result = _result(mode, run, warmup_s, seconds, window, is_short)
    result.rate = rate
    return result
