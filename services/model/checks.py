"""A model server's checks of its own models: readiness runs each one, liveness watches threads.

**Readiness check.** Every `CHECK_INTERVAL_S` (and once right after a version loads, before
its health turns SERVING) each loaded version runs one batch of one sample row through
its own batcher's worker thread, the thread that serves its requests (`ModelRunner.check`:
the zeros it warmed up on, outputs checked against the signature and for NaN and
infinities). A
version passes while its last check answered in time and kept those rules. A check that
does not answer within `CHECK_TIMEOUT_S` fails, and stays failed without queueing another
behind it until it answers: a model stuck in its forward pass shows as its requests would.

**Liveness.** The process is alive while its event loop answers (the health service's
answer itself is the proof: a blocked loop answers nothing, and the caller's timeout says
so) and no model's worker thread has spent more than `WORKER_STALL_S` on one call. A model
that answers wrong numbers fails readiness only: a restart would load the same bytes and
fail the same way, while a thread stuck for good comes back only with a new process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from servemesh.services.model.loader import LoadedModel
from servemesh.services.model.runner import NonFiniteOutput, SignatureViolation

log = logging.getLogger(__name__)

Key = tuple[str, str]

# Envoy health-checks every second and takes a host out after two failures
# (`HealthCheckPolicy`), so a check every 2 s adds at most 2 s before a version that went bad
# leaves its clusters. Each check is one batch of two rows per version: well under a
# millisecond for the demo's MLP, against the ~128-row batches a busy replica runs, so even
# a dozen versions cost the serving thread nothing measurable. Checking every second would
# halve the detection time for twice the batches; beyond a few seconds a bad version serves
# a caller's retries for longer than Envoy's own checks would take to notice a dead host.
CHECK_INTERVAL_S = 2.0
# A check waits behind at most the batch in the worker now (milliseconds; a drill's
# injected latency, 2 s in the slowest test, is not slept by the check itself but is by the
# batch ahead of it). 5 s is far above that and still takes a hung model out within ~7 s.
CHECK_TIMEOUT_S = 5.0
# One call in a model's thread for this long means the thread is stuck for good: no batch
# takes that long (Envoy caps a caller's deadline at 60 s, and batches are sized to answer
# in milliseconds), and a Python thread cannot be interrupted, so only a restart frees it.
# Above CHECK_TIMEOUT_S, so readiness always takes the replica out of Envoy first.
WORKER_STALL_S = 30.0


@dataclass(frozen=True)
class CheckResult:
    """One readiness check of one version."""

    ok: bool
    at: float  # time.time() when it finished (or timed out): what the metrics export
    seconds: float  # how long it took, or waited before it was judged hung
    reason: str = ""  # why it failed; "" when it passed


@dataclass
class _Running:
    """A check handed to a version's worker thread and not answered yet."""

    loaded: LoadedModel
    future: asyncio.Future[Any]
    started: float  # time.monotonic()


def _retrieve(future: asyncio.Future[Any]) -> None:
    # An abandoned check's exception is read, so asyncio does not log it as never retrieved.
    if not future.cancelled():
        future.exception()


class ModelChecks:
    """The readiness check of every loaded version, and its last result.

    `run(models)` checks the given versions at once (each in its own worker thread) and
    records their results; results of versions no longer loaded are dropped by `keep`.
    """

    def __init__(
        self, *, timeout_s: float = CHECK_TIMEOUT_S, stall_s: float = WORKER_STALL_S
    ) -> None:
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        self.results: dict[Key, CheckResult] = {}
        # Which load of each version its result is about (a reload replaces the object).
        self._subjects: dict[Key, LoadedModel] = {}
        self._running: dict[Key, _Running] = {}

    def checked(self, key: Key, loaded: LoadedModel) -> bool:
        """Whether this load of `key` has a result yet."""
        return self._subjects.get(key) is loaded

    def passing(self, key: Key) -> bool:
        result = self.results.get(key)
        return result is not None and result.ok

    def keep(self, keys: set[Key]) -> None:
        """Forget the versions not in `keys` (unloaded): no result, no metric."""
        for key in set(self.results) - keys:
            self.results.pop(key, None)
            self._subjects.pop(key, None)
        for key in set(self._running) - keys:
            self._running.pop(key, None)

    async def run(self, models: Mapping[Key, LoadedModel]) -> None:
        """Check every version in `models` once, concurrently, and record the results."""
        if models:
            await asyncio.gather(*(self._check(key, loaded) for key, loaded in models.items()))

    async def _check(self, key: Key, loaded: LoadedModel) -> None:
        if loaded.batcher.closing:  # unloaded or draining: its thread takes no more work
            return
        running = self._running.get(key)
        if running is None or running.loaded is not loaded or running.future.done():
            future = loaded.batcher.run_in_worker(loaded.runner.check)
            future.add_done_callback(_retrieve)
            running = _Running(loaded, future, time.monotonic())
            self._running[key] = running
        # A check still unanswered from an earlier round keeps its start: it is judged hung
        # once it has waited timeout_s in all, and no second one queues behind it.
        left = running.started + self.timeout_s - time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(running.future), max(left, 0.0))
        except TimeoutError:
            waited = time.monotonic() - running.started
            result = CheckResult(
                ok=False,
                at=time.time(),
                seconds=waited,
                reason=f"no answer from the model's thread after {waited:.1f} s",
            )
        except Exception as exc:
            # The model's own message may carry internals: the type, and ours in full.
            reason = str(exc) if _ours(exc) else f"the model raised {type(exc).__name__}"
            result = CheckResult(
                ok=False, at=time.time(), seconds=time.monotonic() - running.started, reason=reason
            )
        else:
            result = CheckResult(
                ok=True, at=time.time(), seconds=time.monotonic() - running.started
            )
        if self._running.get(key) is running and running.future.done():
            del self._running[key]
        self._record(key, loaded, result)

    def _record(self, key: Key, loaded: LoadedModel, result: CheckResult) -> None:
        if loaded.batcher.closing:  # unloaded while it ran: no result outlives the version
            return
        before = self.results.get(key) if self._subjects.get(key) is loaded else None
        self.results[key] = result
        self._subjects[key] = loaded
        model, version = key
        if result.ok and (before is None or not before.ok):
            if before is not None:
                log.info("model check passes again", extra={"model": model, "version": version})
        elif not result.ok and (before is None or before.ok or before.reason != result.reason):
            log.warning(
                "model check failed",
                extra={"model": model, "version": version, "reason": result.reason},
            )

    def stalled(self, models: Mapping[Key, LoadedModel]) -> list[tuple[Key, float]]:
        """Versions whose thread has spent more than stall_s on one call, and for how long."""
        found: list[tuple[Key, float]] = []
        for key, loaded in models.items():
            busy = loaded.batcher.busy_for()
            if busy > self.stall_s:
                found.append((key, busy))
        return sorted(found)


def _ours(exc: BaseException) -> bool:
    """The runner's own verdicts (signature, finiteness): messages without model internals."""
    return isinstance(exc, SignatureViolation | NonFiniteOutput)
