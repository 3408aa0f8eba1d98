"""Background open-loop load for drills, and the numbers read from it over windows.

The benchmark's load generator (`servemesh.loadgen.open_loop`) runs for a fixed duration and
returns at the end; a drill needs the same open-loop Predict traffic running for as long as
the drill does, readable while it runs. This runs the same request (one entity per call,
cycling through the seeded entities) on the same schedule (a fixed rate, whether or not
earlier calls answered) in a thread with its own event loop, and records the same
`Outcome`s, which probes and the guard read over sliding windows.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from servemesh.loadgen import Outcome, predict_once
from servemesh_api.gateway.v1 import gateway_pb2_grpc


@dataclass(frozen=True)
class WindowStats:
    """What callers saw from requests sent in [start_s, end_s)."""

    start_s: float
    end_s: float
    sent: int
    ok: int
    failed: int
    degraded: int
    success_pct: float  # answered (a degraded fallback is an answer) / sent
    degraded_pct: float  # degraded / answered
    p50_ms: float  # of answered calls
    p99_ms: float
    zones: dict[str, float] = field(default_factory=dict)  # % of answers served per zone
    versions: dict[str, float] = field(default_factory=dict)  # % of answers per version
    codes: dict[str, int] = field(default_factory=dict)  # failures by gRPC status

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key, value in data.items():
            if isinstance(value, float):
                data[key] = None if math.isnan(value) else round(value, 3)
        return data


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def window_stats(outcomes: Iterable[Outcome], start_s: float, end_s: float) -> WindowStats:
    chosen = [o for o in outcomes if start_s <= o.sent_s < end_s]
    ok = [o for o in chosen if o.code == "OK"]
    degraded = sum(o.degraded for o in ok)
    served = [o for o in ok if not o.degraded]
    latencies = [o.latency_ms for o in ok]
    zones = Counter(o.zone or "?" for o in served)
    versions = Counter(o.version or "?" for o in ok)
    return WindowStats(
        start_s=start_s,
        end_s=end_s,
        sent=len(chosen),
        ok=len(ok),
        failed=len(chosen) - len(ok),
        degraded=degraded,
        success_pct=100 * len(ok) / len(chosen) if chosen else float("nan"),
        degraded_pct=100 * degraded / len(ok) if ok else float("nan"),
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        zones={z: 100 * n / len(served) for z, n in sorted(zones.items())},
        versions={v: 100 * n / len(ok) for v, n in sorted(versions.items())},
        codes=dict(Counter(o.code for o in chosen if o.code != "OK")),
    )


class BackgroundLoad:
    """Predict at a fixed rate through the edge until stopped; outcomes readable meanwhile."""

    def __init__(
        self,
        address: str,
        *,
        rate_per_s: float,
        model: str = "fraud",
        entities: int = 100,
        timeout_s: float = 2.0,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be positive")
        self.address = address
        self.rate_per_s = rate_per_s
        self.model = model
        self.entities = max(1, entities)
        self.timeout_s = timeout_s
        self.metadata = tuple(metadata)
        self.outcomes: list[Outcome] = []
        self.sent = 0
        self.error: str = ""
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    # --- clock -------------------------------------------------------------------------

    @property
    def t0(self) -> float:
        """perf_counter() at the first request: time zero of the drill's timeline."""
        return self._t0

    def now_s(self) -> float:
        return time.perf_counter() - self._t0

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="drill-load", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the load generator did not start")

    def stop(self) -> None:
        """Send nothing more, wait for calls in flight (at most their timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 10)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # surfaced in the report; the drill goes on without load
            self.error = f"{type(exc).__name__}: {exc}"
            self._started.set()

    async def _main(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            pending: set[asyncio.Task[None]] = set()

            async def one(index: int, sent_s: float) -> None:
                outcome = await predict_once(
                    stub,
                    model=self.model,
                    entity=f"user-{index % self.entities}",
                    sent_s=sent_s,
                    timeout_s=self.timeout_s,
                    metadata=self.metadata,
                )
                self.outcomes.append(outcome)

            interval = 1.0 / self.rate_per_s
            self._started.set()
            index = 0
            while not self._stop.is_set():
                delay = self._t0 + index * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(min(delay, 0.05))
                    continue
                task = asyncio.create_task(one(index, time.perf_counter() - self._t0))
                pending.add(task)
                task.add_done_callback(pending.discard)
                index += 1
                self.sent = index
            if pending:
                await asyncio.wait(pending, timeout=self.timeout_s + 5)

    # --- reading -----------------------------------------------------------------------

    def snapshot(self) -> list[Outcome]:
        """Outcomes so far, ordered by send time (a copy: the load keeps appending)."""
        return sorted(list(self.outcomes), key=lambda o: o.sent_s)

    def window(self, start_s: float, end_s: float) -> WindowStats:
        return window_stats(list(self.outcomes), start_s, end_s)

    def last(self, seconds: float) -> WindowStats:
        now = self.now_s()
        return self.window(max(0.0, now - seconds), now)
