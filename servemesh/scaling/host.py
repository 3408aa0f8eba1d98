"""The host's own headroom: whether another replica on it could help at all.

Every replica the scaler adds runs on this host. When all its cores are already busy and
more threads wait to run than there are cores, a new replica only divides the same CPU
among more processes, and adds its own start-up and idle cost on top: the latency the
caller pays gets worse, not better. The scaler reads the host from /proc each round and,
when it is saturated, says so instead of adding replicas ("no headroom on this host").

- busy: the share of the host's CPU time spent not idle (nor waiting on I/O) since the last
  reading (/proc/stat, the `cpu` line);
- runnable: threads running or ready to run now (/proc/stat, `procs_running`), the run
  queue;
- saturated: busy at or above `SATURATED_BUSY` and a run queue longer than the cores.

Reading the files is injected (`read`), so tests give the texts a loaded host shows.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# At or above this share of all cores busy, and with more runnable threads than cores, the
# host has no headroom for another replica (the spec's scaling.host.busy_ratio).
SATURATED_BUSY = 0.9

Read = Callable[[str], str]


def _read(path: str) -> str:
    return Path(path).read_text()


@dataclass(frozen=True)
class HostLoad:
    cores: int
    busy: float | None  # 0..1 since the last reading; None: the first reading
    runnable: int

    @property
    def headroom_cores(self) -> float | None:
        """Cores' worth of CPU left idle since the last reading."""
        return None if self.busy is None else round(self.cores * (1 - self.busy), 2)

    @property
    def saturated(self) -> bool:
        return self.saturated_at(SATURATED_BUSY)

    def saturated_at(self, busy_ratio: float) -> bool:
        """No headroom: at least `busy_ratio` of the CPU busy and more runnable threads than
        cores."""
        return self.busy is not None and self.busy >= busy_ratio and self.runnable > self.cores

    def describe(self) -> str:
        busy = "-" if self.busy is None else f"{self.busy:.0%}"
        return f"CPU {busy} busy, run queue {self.runnable} on {self.cores} cores"

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "cores": self.cores,
            "busy": None if self.busy is None else round(self.busy, 3),
            "runnable": self.runnable,
            "headroom_cores": self.headroom_cores,
        }


def cpu_times(stat: str) -> tuple[int, int]:
    """(busy, total) jiffies from /proc/stat's aggregate `cpu` line."""
    for line in stat.splitlines():
        if line.startswith("cpu "):
            fields = [int(v) for v in line.split()[1:]]
            # user nice system idle iowait irq softirq steal (guest time is inside user).
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
            total = sum(fields[:8])
            return total - idle, total
    raise ValueError("/proc/stat has no cpu line")


def runnable(stat: str) -> int:
    for line in stat.splitlines():
        if line.startswith("procs_running "):
            # This reading itself is one of them.
            return max(int(line.split()[1]) - 1, 0)
    raise ValueError("/proc/stat has no procs_running line")


class HostReader:
    """Keeps the last /proc/stat reading; `read` gives the host's load since then."""

    def __init__(self, read: Read = _read, cores: int | None = None) -> None:
        self._read = read
        self._cores = cores if cores is not None else (os.cpu_count() or 1)
        self._last: tuple[int, int] | None = None

    def read(self) -> HostLoad:
        stat = self._read("/proc/stat")
        busy_now, total_now = cpu_times(stat)
        busy: float | None = None
        if self._last is not None and total_now > self._last[1]:
            busy = (busy_now - self._last[0]) / (total_now - self._last[1])
        self._last = (busy_now, total_now)
        return HostLoad(self._cores, busy, runnable(stat))
