"""`servemesh bench scale`: an open-loop ramp of Predicts against three meshes in one run:
(a) fixed at the pool's `min` replicas per zone, (b) fixed at its `max`, (c) autoscaled
from `min` by the scaler process (as `servemesh up` runs it). Each gets the same ramp
(`low` -> `high` -> `low` req/s through the edge over `seconds`); each reports p99 per
window, the share of windows whose p99 is within the SLO, failed calls and the
replica-seconds its scaled pools ran (model servers, gateways and feature services; the
cost proxy: processes started and not yet stopped, sampled every half second, standbys
included). Cold start is measured too: a
replica's process start to every version SERVING, with and without a warm standby.

The goal (issue: autoscaled p99 within the SLO for >= 95% of the ramp at <= 0.7x the
replica-seconds of fixed max, 0 failed calls) is printed from the numbers of this run.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from servemesh.bench.observe import bench_credentials, wait_answering
from servemesh.bench.predict import one_zone_spec
from servemesh.bench.report import BenchReport, progress
from servemesh.identity import dial_every_edge
from servemesh.launcher import Mesh
from servemesh.load import BackgroundLoad, percentile, predict_target
from servemesh.load.drive import open_loop
from servemesh.load.run import LoadRun
from servemesh.load.schedule import SendTimes
from servemesh.rollout.fleet import fleet_status
from servemesh.scaling.history import read_history
from servemesh.spec import MeshSpec
from servemesh.spec.scaling_policy import EdgeSignalSpec, PoolPolicy, ScalingSpec, ScalingTargets

WINDOW_S = 5.0
GOAL_WITHIN_SLO = 0.95
GOAL_COST_RATIO = 0.7


def ramp_times(low: float, high: float, seconds: float) -> list[float]:
    """Send times of a rate rising linearly from `low` to `high` over the first half of
    `seconds` and back over the second."""
    times: list[float] = []
    at = 0.0
    half = seconds / 2
    while at < seconds:
        share = at / half if at < half else (seconds - at) / half
        rate = low + (high - low) * share
        times.append(at)
        at += 1.0 / max(rate, 1e-3)
    return times


@dataclass
class ModeResult:
    mode: str
    windows_p99_ms: list[float]
    within_slo: float  # share of windows with p99 <= the SLO
    failed: int
    calls: int
    replica_seconds: float
    peak_replicas: int
    decisions: list[str] = field(default_factory=list)


# The kinds the scaler grows: every one's processes count towards a mode's cost.
SCALED_KINDS = ("model", "gateway", "feature")


class ReplicaMeter:
    """Integrates the scaled processes (model servers, gateways, feature services) the mesh
    reports running, every `every_s`."""

    def __init__(self, state_dir: Path, every_s: float = 0.5) -> None:
        self.state_dir = state_dir
        self.every_s = every_s
        self.seconds = 0.0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-meter", daemon=True)

    def _count(self) -> int:
        status = fleet_status(self.state_dir)
        return sum(
            1
            for entry in status.values()
            if isinstance(entry, dict) and entry.get("service") in SCALED_KINDS and entry.get("pid")
        )

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.every_s):
            now = time.monotonic()
            count = self._count()
            self.seconds += count * (now - last)
            self.peak = max(self.peak, count)
            last = now

    def __enter__(self) -> ReplicaMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def bench_spec(spec: MeshSpec, replicas: int, scaling: ScalingSpec) -> MeshSpec:
    """One zone (the ramp's load on one pool), free ports, no Prometheus."""
    return one_zone_spec(spec, replicas).model_copy(update={"scaling": scaling})


def run_mode(
    spec: MeshSpec, mode: str, scaler: bool, times: list[float], slo_ms: float
) -> ModeResult:
    with tempfile.TemporaryDirectory(prefix="servemesh-bench-scale-") as state:
        mesh = Mesh.from_spec(spec.model_copy(update={"state_dir": state}), Path(state))
        mesh.scaler = scaler
        with mesh:
            wait_answering(mesh)
            target = predict_target(
                dial_every_edge(mesh.spec),
                entities=500,
                timeout_s=5.0,
                metadata=bench_credentials(mesh.spec),
            )
            run = LoadRun()
            with ReplicaMeter(mesh.state_dir) as meter:
                asyncio.run(open_loop(target, SendTimes(times), run=run, drain_s=10.0))
            outcomes = run.snapshot()
            decisions = [e["line"] for e in read_history(mesh.state_dir)]
    seconds = times[-1] if times else 0.0
    windows = []
    start = 0.0
    while start < seconds:
        chosen = [o.latency_ms for o in outcomes if start <= o.sent_s < start + WINDOW_S and o.ok]
        if chosen:
            windows.append(round(percentile(chosen, 99), 2))
        start += WINDOW_S
    failed = sum(1 for o in outcomes if not o.ok)
    within = sum(1 for p in windows if p <= slo_ms) / len(windows) if windows else 0.0
    return ModeResult(
        mode=mode,
        windows_p99_ms=windows,
        within_slo=round(within, 3),
        failed=failed,
        calls=len(outcomes),
        replica_seconds=round(meter.seconds, 1),
        peak_replicas=meter.peak,
        decisions=decisions,
    )


def cold_starts(spec: MeshSpec, repeats: int) -> dict[str, list[float]]:
    """Seconds from a scale-up's decision to the new replica in rotation (and Envoy counting
    it healthy): with a warm standby, and without (a process started, loaded and warmed)."""
    found: dict[str, list[float]] = {"standby": [], "cold": []}
    # A target no call meets: the load below asks for a replica at once, whatever the
    # machine's speed (what is timed is the step, not the threshold).
    eager = ScalingTargets(p99_ms=0.5, queue_depth=None, cpu=None)
    for standby in (1, 0):
        for _ in range(repeats):
            policy = spec.scaling.model_servers.model_copy(
                update={"standby": standby, "target": eager, "max": 2}
            )
            scaling = spec.scaling.model_copy(update={"model_servers": policy})
            with tempfile.TemporaryDirectory(prefix="servemesh-bench-cold-") as state:
                one = spec.model_copy(update={"scaling": scaling, "state_dir": state})
                mesh = Mesh.from_spec(one, Path(state))
                mesh.scaler = True
                with mesh:
                    wait_answering(mesh)
                    if standby:
                        _wait(partial(_standby_warm, mesh), 180)
                    target = predict_target(
                        dial_every_edge(mesh.spec),
                        entities=500,
                        timeout_s=5.0,
                        metadata=bench_credentials(mesh.spec),
                    )
                    load = BackgroundLoad(target, rate_per_s=50)
                    load.start()
                    try:
                        _wait(partial(_grown, mesh), 180)
                    finally:
                        load.stop()
                    entry = next(e for e in read_history(mesh.state_dir) if e["to"] > e["from"])
                    found["standby" if standby else "cold"].append(float(entry["seconds"]))
    return found


def _standby_warm(mesh: Mesh) -> bool:
    """The scaler started the pool's standby and it holds every version."""
    from servemesh.proxy.apply import RouteManager
    from servemesh.proxy.replicas import served_health_names, version_health
    from servemesh.scaling.actuator import zone_replicas

    live = RouteManager(mesh.paths).live_spec()
    spare = zone_replicas(live, live.zones[0])[1]
    return bool(spare) and all(
        all(version_health(live, n, served_health_names(live, n)).values()) for n in spare
    )


def _grown(mesh: Mesh) -> bool:
    return any(e["to"] > e["from"] and e["outcome"] == "done" for e in read_history(mesh.state_dir))


def _wait(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the mesh did not get there in time")
        time.sleep(0.2)


def bench_scale(
    spec: MeshSpec,
    *,
    low: float,
    high: float,
    seconds: float,
    slo_ms: float,
    min_replicas: int,
    max_replicas: int,
    cold_repeats: int,
    progress: Callable[[ModeResult], None] = lambda _: None,
) -> dict[str, object]:
    policy = PoolPolicy(
        min=min_replicas,
        max=max_replicas,
        target=ScalingTargets(p99_ms=slo_ms * 0.6, queue_depth=4.0, cpu=0.6),
        up_window="4s",
        down_window="15s",
        cooldown="5s",
    )
    # The caller's objective at the edge is the SLO measured here (scaling.edge); the
    # gateways and feature services keep their default pools (1..2).
    scaling = ScalingSpec(interval="1s", model_servers=policy, edge=EdgeSignalSpec(p99_ms=slo_ms))
    times = ramp_times(low, high, seconds)
    results = []
    for mode, replicas, scaler in (
        ("fixed min", min_replicas, False),
        ("fixed max", max_replicas, False),
        ("autoscaled", min_replicas, True),
    ):
        found = run_mode(bench_spec(spec, replicas, scaling), mode, scaler, times, slo_ms)
        progress(found)
        results.append(found)
    cold = cold_starts(bench_spec(spec, min_replicas, scaling), cold_repeats)
    by = {r.mode: r for r in results}
    auto, most = by["autoscaled"], by["fixed max"]
    cost_ratio = auto.replica_seconds / most.replica_seconds if most.replica_seconds else 0.0
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "ramp": {"low": low, "high": high, "seconds": seconds, "calls": len(times)},
        "slo_p99_ms": slo_ms,
        "policy": policy.model_dump(mode="json"),
        "modes": [asdict(r) for r in results],
        "cold_start_s": {
            k: {"runs": v, "median": round(statistics.median(v), 2) if v else None}
            for k, v in cold.items()
        },
        "autoscaled_over_max_replica_seconds": round(cost_ratio, 3),
        "goals": [
            {
                "goal": f"autoscaled p99 within the SLO in >= {GOAL_WITHIN_SLO:.0%} of windows",
                "measured": auto.within_slo,
                "met": auto.within_slo >= GOAL_WITHIN_SLO,
            },
            {
                "goal": f"autoscaled replica-seconds <= {GOAL_COST_RATIO}x fixed max",
                "measured": round(cost_ratio, 3),
                "met": cost_ratio <= GOAL_COST_RATIO,
            },
            {
                "goal": "0 failed calls (autoscaled)",
                "measured": auto.failed,
                "met": auto.failed == 0,
            },
        ],
    }


def mode_line(found: ModeResult) -> str:
    return (
        f"  {found.mode}: {found.calls:,} calls, {found.failed} failed, "
        f"{found.replica_seconds:.0f} replica-s"
    )


def as_report(report: Mapping[str, object]) -> BenchReport:
    """The run for people: each mode's windows within the SLO, failed calls and
    replica-seconds, the scaler's decisions, the cold starts, the goals."""
    ramp = report["ramp"]
    assert isinstance(ramp, dict)
    shown = BenchReport(
        "servemesh bench scale",
        report,
        title=f"ramp {ramp['low']:g} -> {ramp['high']:g} -> {ramp['low']:g} req/s over "
        f"{ramp['seconds']:g} s ({ramp['calls']:,} calls), SLO p99 {report['slo_p99_ms']:g} ms",
    )
    columns = ("p99 within", "worst p99", "failed", "replica-s", "peak")
    widths = (10, 10, 7, 10, 5)
    lines = [f"{'mode':<11} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))]
    for mode in report["modes"]:  # type: ignore[attr-defined]
        worst = max(mode["windows_p99_ms"], default=float("nan"))
        lines.append(
            f"{mode['mode']:<11} {mode['within_slo']:>10.0%} {worst:>9.1f}  {mode['failed']:>7} "
            f"{mode['replica_seconds']:>10.1f} {mode['peak_replicas']:>5}"
        )
    for mode in report["modes"]:  # type: ignore[attr-defined]
        lines += [f"  {mode['mode']}: {line}" for line in mode["decisions"]]
    cold = report["cold_start_s"]
    assert isinstance(cold, dict)
    lines.append(
        f"scale-up decision to in rotation: with a warm standby {cold['standby']['median']} s, "
        f"cold {cold['cold']['median']} s (median of {len(cold['cold']['runs'])})"
    )
    lines += [
        f"  {goal['goal']}: {goal['measured']} {'met' if goal['met'] else 'MISSED'}"
        for goal in report["goals"]  # type: ignore[attr-defined]
    ]
    shown.note("\n".join(lines))
    return shown


def main(
    spec: str | None,
    *,
    low: float,
    high: float,
    seconds: float,
    slo_ms: float,
    min_replicas: int,
    max_replicas: int,
    cold_repeats: int,
    quiet: bool = False,
) -> BenchReport:
    """The spec file, else the built-in spec."""
    from servemesh.spec import load_spec

    return as_report(
        bench_scale(
            load_spec(spec) if spec else MeshSpec(),
            low=low,
            high=high,
            seconds=seconds,
            slo_ms=slo_ms,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            cold_repeats=cold_repeats,
            progress=progress(quiet, mode_line),
        )
    )
