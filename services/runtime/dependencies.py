"""Deep health: a service is SERVING only while what it needs to answer answers.

A service with dependencies (the feature service's Redis, the gateway's path downstream)
gives a `DependencyWatch` a probe; the watch runs it on a short interval, and on demand
when a request saw the dependency fail, and turns the server's health (overall and every
service name) with a `Debounce`: several failed rounds in a row to go down, one good
round to come back. Each transition is logged once, with the reason, never each probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from servemesh.services.runtime.server import ServiceServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """One probe round: can the service answer now, and if not, why."""

    ok: bool
    reason: str = ""


Probe = Callable[[], Awaitable[Verdict]]


@dataclass
class Debounce:
    """Down after `failures_to_fail` failed rounds in a row, up again after one good round.

    Why asymmetric: going down takes the replica out of Envoy's rotation, so one slow
    answer (a PING behind a burst of reads, a busy core) must not do it; several failures in
    a row are an outage. Coming back is safe at the first good round: Envoy itself wants
    `healthy_threshold` good checks before it routes again, and a replica kept out after
    its dependency returned only loses capacity. `up` is None until the first round.
    """

    failures_to_fail: int = 3
    up: bool | None = None
    failures: int = 0

    def observe(self, ok: bool) -> bool:
        """Take one round; True when the verdict changed."""
        if ok:
            self.failures = 0
            changed = self.up is not True
            self.up = True
            return changed
        self.failures += 1
        # Before any good round there is nothing to protect from flapping: down at once.
        if self.up is None or (self.up and self.failures >= self.failures_to_fail):
            self.up = False
            return True
        return False


class DependencyWatch:
    """Probes a service's dependencies and turns its health with the debounced verdict."""

    def __init__(
        self,
        server: ServiceServer,
        probe: Probe,
        *,
        what: str,
        interval_s: float = 0.5,
        down_interval_s: float = 0.1,
        failures_to_fail: int = 3,
        min_gap_s: float = 0.05,
    ) -> None:
        self.server = server
        self.probe = probe
        self.what = what
        self.interval_s = interval_s
        # While down, probe more often: every moment out of rotation after the dependency
        # returned is capacity lost (and Envoy's own checks still come on top).
        self.down_interval_s = down_interval_s
        # A burst of failing requests pokes many times; probes stay this far apart.
        self.min_gap_s = min_gap_s
        self.debounce = Debounce(failures_to_fail)
        self.last = Verdict(False, "not probed yet")
        self._poked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # NOT_SERVING from the start until the first good round.
        server.expect_dependency_check()

    @property
    def up(self) -> bool:
        return self.debounce.up is True

    def poke(self) -> None:
        """Probe now rather than at the next interval (a request saw the dependency fail)."""
        self._poked.set()

    def start(self) -> None:
        """Probe until the server stops (call inside the running loop)."""
        self._task = asyncio.get_running_loop().create_task(self.run())

        async def stop() -> None:
            if self._task is not None:
                self._task.cancel()

        self.server.on_stop(stop)

    async def round(self) -> None:
        """One probe; the server's health follows when the debounced verdict changes."""
        try:
            verdict = await self.probe()
        except Exception as exc:  # a probe that breaks is a failed round, not a dead watch
            verdict = Verdict(False, f"probe failed: {exc!r}"[:300])
        self.last = verdict
        if not self.debounce.observe(verdict.ok):
            return
        if verdict.ok:
            log.info("ready: dependencies answer", extra={"dependency": self.what})
        else:
            log.warning(
                "not ready: a dependency does not answer",
                extra={
                    "dependency": self.what,
                    "reason": verdict.reason,
                    "failed_rounds": self.debounce.failures,
                },
            )
        await self.server.set_dependencies_ok(verdict.ok)

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            self._poked.clear()
            await self.round()
            interval = self.interval_s if self.up else self.down_interval_s
            try:
                # asyncio.timeout, not wait_for: on 3.11 a cancel landing as the poke fires
                # is lost by wait_for, and the prober would outlive its server.
                async with asyncio.timeout(interval):
                    await self._poked.wait()
            except TimeoutError:
                continue
            # Poked: probe again soon, but not sooner than min_gap_s after the last one.
            gap = self.min_gap_s - (time.monotonic() - started)
            if gap > 0:
                await asyncio.sleep(gap)
