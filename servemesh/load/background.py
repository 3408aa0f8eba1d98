"""An open-loop load that runs until stopped, in a thread with its own event loop, and can
be read while it runs (the drills' load: probes and the guard read its windows)."""

from __future__ import annotations

import asyncio
import threading
import time

from servemesh.load.drive import open_loop
from servemesh.load.outcome import Outcome
from servemesh.load.run import LoadRun
from servemesh.load.schedule import FixedRate
from servemesh.load.stats import WindowStats, window_stats
from servemesh.load.target import Target


class BackgroundLoad:
    """`target` at `rate_per_s` from start() to stop(); outcomes readable meanwhile.

    Time zero is start(): `now_s()`, every outcome's `sent_s` and every window are on that
    clock. On stop, calls in flight get `drain_s` to answer.
    """

    def __init__(self, target: Target, *, rate_per_s: float, drain_s: float = 10.0) -> None:
        self.target = target
        self.schedule = FixedRate(rate_per_s)  # validates the rate
        self.rate_per_s = rate_per_s
        self.drain_s = drain_s
        self.run = LoadRun()
        self.error: str = ""
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    # --- clock -------------------------------------------------------------------------

    @property
    def t0(self) -> float:
        """perf_counter() at start(): time zero of the load's timeline."""
        return self.run.origin

    def now_s(self) -> float:
        return self.run.now_s()

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.run = LoadRun(origin=time.perf_counter())
        self._thread = threading.Thread(target=self._main, name="background-load", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the load generator did not start")

    def stop(self) -> None:
        """Send nothing more; wait for calls in flight (at most `drain_s`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.drain_s + 10)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _main(self) -> None:
        try:
            asyncio.run(self._send())
        except Exception as exc:  # kept for the caller's report; the load is gone
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._started.set()

    async def _send(self) -> None:
        self._started.set()
        await open_loop(
            self.target, self.schedule, stop=self._stop, drain_s=self.drain_s, run=self.run
        )

    # --- reading -----------------------------------------------------------------------

    @property
    def outcomes(self) -> list[Outcome]:
        """The live list of outcomes, in order of completion (copy it before iterating at
        length: the load keeps appending)."""
        return self.run.outcomes

    @property
    def sent(self) -> int:
        return self.run.scheduled

    def snapshot(self) -> list[Outcome]:
        """Outcomes so far, ordered by send time."""
        return self.run.snapshot()

    def window(self, start_s: float, end_s: float) -> WindowStats:
        return window_stats(list(self.run.outcomes), start_s, end_s)

    def last(self, seconds: float) -> WindowStats:
        now = self.now_s()
        return self.window(max(0.0, now - seconds), now)
