"""When to start a crashed child again: crash-loop backoff, kept apart from the processes.

    restarts = Restarts(SERVICE_RESTARTS, clock=time.monotonic)
    restarts.started("model-fraud-zone-a-0")              # at each start, deliberate or not
    delay = restarts.exited("model-fraud-zone-a-0", -11)  # the launcher saw it exit unexpectedly
    if restarts.due("model-fraud-zone-a-0"):              # polled; True once the delay passed
        ...start it...; restarts.restarted("model-fraud-zone-a-0")

Pure bookkeeping with an injected clock: no process, no sleep, no thread. Whoever owns the
children (servemesh.launcher) decides which exits are unexpected and does the starting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(frozen=True)
class RestartPolicy:
    """How long a crashed child waits before it is started again.

    The first restart comes soon (`first_delay_s`): a lone crash should cost a replica
    seconds, not minutes. Each further crash in a row doubles the wait, up to `max_delay_s`,
    so a child that dies at start (a bad artifact, a port taken) neither burns the host's
    CPU on torch imports nor floods its log, yet is still tried twice a minute in case the
    cause went away. A child that stayed up `stable_s` is healthy again: its next crash is
    a first crash. `immediate_first` skips the wait of the first restart, for processes
    whose absence takes out more than one replica (a zone's Envoy) and that start in
    milliseconds; later crashes in a row still back off (1 s, 2 s, ...).
    """

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_s: float = 60.0
    immediate_first: bool = False

    def delay_s(self, crashes: int) -> float:
        """The wait before the restart that follows the `crashes`-th crash in a row (1-based)."""
        if crashes < 1:
            raise ValueError(f"crashes counts from 1, not {crashes}")
        if self.immediate_first:
            if crashes == 1:
                return 0.0
            crashes -= 1
        # min() before the power would overflow for a child that crashed a thousand times.
        doublings = min(crashes - 1, 32)
        return float(min(self.max_delay_s, self.first_delay_s * 2.0**doublings))


# Model servers, gateways, feature services, the registry, the trace store.
SERVICE_RESTARTS = RestartPolicy()
# The Envoys of the per-zone layout: an Envoy down is a zone (or the edge) down, and it is
# ready in well under a second, so its first restart does not wait.
ENVOY_RESTARTS = RestartPolicy(immediate_first=True)


@dataclass
class RestartRecord:
    """One child's restart history, as the launcher reports it (fleet status)."""

    # Times it was started again after an unexpected exit (deliberate restarts not counted).
    restarts: int = 0
    # Its last unexpected exit status (negative: the signal that ended it), None: none yet.
    last_exit: int | None = None
    # Unexpected exits in a row, the last one included; 0 once it stayed up a stable while.
    crashes: int = 0
    # Clock readings: its current process's start; when its pending restart is due.
    started_at: float | None = None
    due_at: float | None = None


class Restarts:
    """Every child's restart record, by name, under one policy per child."""

    def __init__(
        self, policy: Callable[[str], RestartPolicy], clock: Clock = time.monotonic
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._records: dict[str, RestartRecord] = {}

    def record(self, name: str) -> RestartRecord:
        return self._records.setdefault(name, RestartRecord())

    def started(self, name: str) -> None:
        """A process of `name` was started (first, or deliberately again): its stable
        while counts from now, and no automatic restart is pending any more."""
        record = self.record(name)
        record.started_at = self._clock()
        record.due_at = None

    def exited(self, name: str, status: int | None) -> float:
        """`name` exited unexpectedly with `status`: counts the crash and schedules its
        restart; the wait in seconds."""
        now = self._clock()
        record = self.record(name)
        if record.started_at is not None and now - record.started_at >= self._policy(name).stable_s:
            record.crashes = 0  # it had been healthy: this crash starts a new streak
        record.crashes += 1
        record.last_exit = status
        delay = self._policy(name).delay_s(record.crashes)
        record.due_at = now + delay
        return delay

    def pending(self, name: str) -> bool:
        """Whether a restart of `name` is scheduled and not yet done."""
        record = self._records.get(name)
        return record is not None and record.due_at is not None

    def due(self, name: str) -> bool:
        """Whether the scheduled restart of `name` may happen now."""
        record = self._records.get(name)
        return record is not None and record.due_at is not None and self._clock() >= record.due_at

    def restarted(self, name: str) -> None:
        """The scheduled restart of `name` happened: one more restart, a new process."""
        record = self.record(name)
        record.restarts += 1
        self.started(name)

    def crashes_in_a_row(self, name: str) -> int:
        """Unexpected exits in a row; 0 once the current process stayed up a stable while."""
        record = self._records.get(name)
        if record is None:
            return 0
        up_s = None if record.started_at is None else self._clock() - record.started_at
        if record.due_at is None and up_s is not None and up_s >= self._policy(name).stable_s:
            return 0
        return record.crashes

    def forget(self, name: str) -> None:
        """`name` is gone for good (dropped from the fleet) or replaced by a new generation."""
        self._records.pop(name, None)

    def snapshot(self) -> dict[str, RestartRecord]:
        """A copy of every record, by name."""
        return {name: RestartRecord(**vars(r)) for name, r in self._records.items()}
