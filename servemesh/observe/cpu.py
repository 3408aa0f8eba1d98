"""CPU seconds and resident (and proportional) memory of a process from /proc (Envoy and
Redis, whose own metrics do not carry them), and the cost arithmetic of a million
predictions."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid` in seconds; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return None
    # The command name may hold spaces: fields count from after its closing parenthesis.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found: list[int] = []
    pending = list(children.get(pid, []))
    while pending:
        child = pending.pop()
        found.append(child)
        pending.extend(children.get(child, []))
    return found


def rss_bytes(pid: int) -> int | None:
    """A process's resident set (VmRSS in /proc/PID/status); None once it is gone."""
    return _kib_field(Path(f"/proc/{pid}/status"), "VmRSS:")


def pss_bytes(pid: int) -> int | None:
    """A process's proportional set (Pss in /proc/PID/smaps_rollup): its private pages, and
    each page it shares counted as its share of it. Summed over processes it is the memory
    they use together, where VmRSS counts a library two processes map twice (torch in every
    model server). None once it is gone, or where the kernel has no smaps_rollup."""
    return _kib_field(Path(f"/proc/{pid}/smaps_rollup"), "Pss:")


def _kib_field(path: Path, name: str) -> int | None:
    """The `name` line of a /proc file that counts in kB (`VmRSS:   1234 kB`), in bytes;
    None when the file cannot be read (the process is gone) or has no such line."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name):
            return int(line.split()[1]) * 1024
    return None


@dataclass(frozen=True)
class Cost:
    """What a million successful predictions cost over a measured span."""

    predictions: float
    cpu_seconds: float  # every mesh process together
    cpu_by_part: dict[str, float]  # gateway, feature, model, registry, envoy, redis
    gpus: int  # GPUs held by model servers
    seconds: float  # the span measured
    price_per_core_hour: float
    price_per_gpu_hour: float

    @property
    def cpu_seconds_per_million(self) -> float:
        return self.cpu_seconds / self.predictions * 1e6 if self.predictions else float("nan")

    @property
    def gpu_seconds_per_million(self) -> float:
        if not self.predictions:
            return float("nan")
        return self.gpus * self.seconds / self.predictions * 1e6

    @property
    def price_per_million(self) -> float:
        return (
            self.cpu_seconds_per_million * self.price_per_core_hour
            + self.gpu_seconds_per_million * self.price_per_gpu_hour
        ) / 3600

    def as_dict(self) -> dict[str, object]:
        return {
            "predictions": round(self.predictions),
            "seconds": round(self.seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "cpu_seconds_by_part": {k: round(v, 3) for k, v in sorted(self.cpu_by_part.items())},
            "gpus": self.gpus,
            "cpu_seconds_per_million": _round(self.cpu_seconds_per_million, 1),
            "gpu_seconds_per_million": _round(self.gpu_seconds_per_million, 1),
            "price_per_core_hour": self.price_per_core_hour,
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "price_per_million": _round(self.price_per_million, 4),
        }


def _round(value: float, digits: int) -> float | None:
    return None if value != value else round(value, digits)  # NaN: nothing to divide by
