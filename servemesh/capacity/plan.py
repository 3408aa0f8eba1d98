"""From a step load's measurements to a capacity plan: replicas per kind, headroom, cost.

The probe (servemesh/bench/capacity_probe.py) drives one replica of each kind at rising rates
until the SLO breaks. The last step within the SLO (the knee) says what a call costs each
kind in CPU;
a replica given `cost.cores_per_replica` cores then carries that many cores' worth of
calls a second. The plan asks, per kind, for the fewest replicas that carry the target
rate with the headroom left free, and prices them: cores, resident memory and GPUs by the
hour (`cost:` in the spec), and per million predictions at the target rate.

Why CPU and not the knee rate itself: one replica of each kind shares the machine the probe
runs on with the others, the Envoy, Redis and the load, so the knee is the whole mesh's on
that machine, not any one replica's. CPU per call is what each process spent, whoever its
neighbours were; the knee is printed beside it as what was measured whole.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servemesh.contract.atomic import atomic_write_text
from servemesh.spec import CostSpec

# The kinds a plan counts, in the order it prints them. Envoy and Redis are counted as
# processes like the services are (one Envoy or Redis can be given more cores instead).
KINDS = ("gateway", "feature", "model", "envoy", "redis")
# A step whose failed share is above this is over the SLO, whatever its p99.
MAX_FAILED_SHARE = 0.001
FOLDER = "capacity"


@dataclass(frozen=True)
class Step:
    """One rate of the step load, and what the mesh did at it."""

    rate_rps: float  # offered
    seconds: float
    calls: int
    ok: int
    p99_ms: float  # of the answered calls
    cpu_seconds: dict[str, float]  # by kind, over the step
    rss_gib: dict[str, float]  # one replica of each kind, at the step's end
    gpus: int = 0  # held by the model server

    @property
    def failed_share(self) -> float:
        return (self.calls - self.ok) / self.calls if self.calls else 1.0

    def within(self, p99_ms: float) -> bool:
        return self.ok > 0 and self.p99_ms <= p99_ms and self.failed_share <= MAX_FAILED_SHARE


@dataclass(frozen=True)
class KindCapacity:
    kind: str
    cpu_ms_per_call: float
    rps_per_replica: float  # at cores_per_replica cores, fully busy
    rss_gib: float


def knee(steps: Sequence[Step], p99_ms: float) -> Step | None:
    """The last step within the SLO before the first that is not (steps in rising order)."""
    found = None
    for step in steps:
        if not step.within(p99_ms):
            break
        found = step
    return found


def capacities(at: Step, cores_per_replica: float) -> dict[str, KindCapacity]:
    """What one replica of each kind carries, from the CPU each spent per call at `at`."""
    found = {}
    for kind in KINDS:
        seconds = at.cpu_seconds.get(kind)
        if seconds is None or at.ok == 0:
            continue
        per_call = max(seconds, 1e-9) / at.ok
        found[kind] = KindCapacity(
            kind=kind,
            cpu_ms_per_call=round(per_call * 1000, 4),
            rps_per_replica=round(cores_per_replica / per_call, 1),
            rss_gib=round(at.rss_gib.get(kind, 0.0), 4),
        )
    return found


@dataclass(frozen=True)
class KindPlan:
    kind: str
    replicas: int
    rps_per_replica: float
    utilisation: float  # of the planned replicas at the target rate
    cost_per_hour: float


@dataclass(frozen=True)
class Plan:
    model: str
    target_rps: float
    p99_ms: float
    headroom: float  # asked for
    kinds: list[KindPlan]
    cost_per_hour: float
    cost_per_million: float
    knee_rps: float | None  # the whole one-of-each mesh, as measured
    knee_p99_ms: float | None
    prices: dict[str, float] = field(default_factory=dict)


def plan_for(
    model: str,
    caps: Mapping[str, KindCapacity],
    *,
    target_rps: float,
    p99_ms: float,
    headroom: float,
    cost: CostSpec,
    gpus_per_model_replica: int = 0,
    at: Step | None = None,
) -> Plan:
    """The fewest replicas of each kind that carry `target_rps` with `headroom` (a share
    of each replica's capacity) left free, and what they cost."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom is a share in [0, 1), got {headroom}")
    usable = 1.0 - headroom
    kinds = []
    for kind in KINDS:
        cap = caps.get(kind)
        if cap is None:
            continue
        replicas = max(1, math.ceil(round(target_rps / (cap.rps_per_replica * usable), 9)))
        gpus = gpus_per_model_replica if kind == "model" else 0
        hourly = replicas * (
            cost.cores_per_replica * cost.per_core_hour
            + cap.rss_gib * cost.per_gib_hour
            + gpus * cost.per_gpu_hour
        )
        kinds.append(
            KindPlan(
                kind=kind,
                replicas=replicas,
                rps_per_replica=cap.rps_per_replica,
                utilisation=round(target_rps / (replicas * cap.rps_per_replica), 3),
                cost_per_hour=round(hourly, 4),
            )
        )
    per_hour = sum(k.cost_per_hour for k in kinds)
    calls_per_hour = target_rps * 3600
    return Plan(
        model=model,
        target_rps=target_rps,
        p99_ms=p99_ms,
        headroom=headroom,
        kinds=kinds,
        cost_per_hour=round(per_hour, 4),
        cost_per_million=round(per_hour / calls_per_hour * 1e6, 4) if calls_per_hour else 0.0,
        knee_rps=None if at is None else at.rate_rps,
        knee_p99_ms=None if at is None else at.p99_ms,
        prices={
            "per_core_hour": cost.per_core_hour,
            "per_gib_hour": cost.per_gib_hour,
            "per_gpu_hour": cost.per_gpu_hour,
            "cores_per_replica": cost.cores_per_replica,
        },
    )


# --- what is kept: the measured capacity, reused by the scaler's forecast --------------


def record_path(state_dir: str | Path, model: str) -> Path:
    return Path(state_dir) / FOLDER / f"{model}.json"


def save_measurement(
    state_dir: str | Path,
    model: str,
    steps: Sequence[Step],
    caps: Mapping[str, KindCapacity],
    p99_ms: float,
) -> Path:
    path = record_path(state_dir, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "model": model,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "p99_ms": p99_ms,
        "steps": [asdict(s) for s in steps],
        "capacity": {k: asdict(c) for k, c in caps.items()},
    }
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    return path


def read_measurement(state_dir: str | Path, model: str) -> dict[str, Any] | None:
    path = record_path(state_dir, model)
    try:
        found: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found


def measured_model_capacity(state_dir: str | Path, models: Sequence[str]) -> float | None:
    """Calls/s one model server carries, by the last capacity plans of `models` (the
    least of them: the model servers serve every model); None when none was measured."""
    found = []
    for model in models:
        record = read_measurement(state_dir, model)
        cap = (record or {}).get("capacity", {}).get("model", {}).get("rps_per_replica")
        if isinstance(cap, int | float) and cap > 0:
            found.append(float(cap))
    return min(found) if found else None
