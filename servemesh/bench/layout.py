"""`servemesh bench layout`: what the mesh's shape costs, two or more shapes in one run.

The shapes ("arms") are the spec itself with one change each:

- `shared`: `proxy.layout: shared`, one Envoy for the edge and every zone;
- `per_zone`: `proxy.layout: per_zone`, the edge's Envoy and one per zone;
- `small-host`: `profile: small-host` (servemesh.spec.profile_preset): one feature and
  one model process serve every zone, one Envoy;
- `exec`: `per_zone` with `processes.fork_server: false`, every Python service exec'd
  instead of forked from the fork server (servemesh.procs.forkserver);
- `one-edge`: `per_zone` with one edge Envoy and no registry mirror (`proxy.edges: one`,
  `registry.mirrors: none`): what an edge per zone and the mirrors cost;
- `replicated`: `per_zone` with `feature_store.topology: replicated` (a replica and a
  Sentinel per zone, the zones' feature services reading their replica): what the
  replicated store costs, and whether reads from a replica are as fast.

For each repeat, the order turning, one mesh per arm, on free ports, Prometheus off (every
arm alike):

- start-up: `Mesh.start()` until every service is SERVING and the edge answers, and the
  CPU (user + system) every process below this one has used by then (the fork server's
  imports included);
- memory: the resident set (VmRSS) of every process the mesh started, summed by kind
  (every Envoy counts as `envoy`, the fork servers as `forkserver`), once Predicts are
  answered and the mesh has sat idle a moment;
- idle CPU: user + system CPU of those processes over `idle_s` with no traffic, in ms/s;
- Predict through the edge at c=1 (p50) and at c=`concurrency` (req/s), `seconds` each;
- GetFeatures through zone-a's mesh listener, as a gateway reads (one entity, packed), at
  c=1 (p50) and c=`feature_concurrency` (req/s, p50), `seconds` each.

The launcher runs inside this process in every arm, so its own memory is left out of all.
Each figure is the median of its repeats with min-max; the ratios of each arm to the first
are taken per repeat, from meshes measured back to back.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from servemesh.bench.observe import (
    bench_credentials,
    process_kind,
    sum_by_kind,
    wait_answering,
)
from servemesh.bench.predict import CALL_TIMEOUT_S, bench_spec, measure
from servemesh.bench.report import BenchReport, progress
from servemesh.contract.errors import UsageError
from servemesh.identity import dial_every_edge, dial_mesh
from servemesh.launcher import Mesh
from servemesh.load import features_target, predict_target
from servemesh.load.stats import spread
from servemesh.observe.cpu import descendants, proc_cpu_seconds, rss_bytes
from servemesh.spec import EDGE_PROXY, MeshSpec, ResolvedSpec, load_spec, with_profile

Arm = Literal["shared", "per_zone", "small-host", "exec", "one-edge", "replicated"]
ARMS: tuple[Arm, ...] = ("shared", "per_zone", "small-host", "exec", "one-edge", "replicated")
DEFAULT_ARMS: tuple[Arm, ...] = ("shared", "per_zone")
# Idle before memory is read: the first health-check rounds and lazy imports are done.
SETTLE_S = 2.0


@dataclass(frozen=True)
class LayoutRound:
    """One mesh of one arm, measured once."""

    arm: Arm
    repeat: int
    startup_s: float
    startup_cpu_s: float  # every process below the bench's, at ready
    envoys: int
    processes: int  # the mesh's own, Envoys and Redis included
    rss_mib: dict[str, float]  # by kind
    idle_cpu_ms_per_s: dict[str, float]  # by kind
    p50_ms_c1: float
    rps: float  # at the round's concurrency
    p99_ms: float
    errors: int
    # GetFeatures through zone-a's mesh listener (as a gateway reads): p50 at c=1, req/s
    # and p50 at the round's feature concurrency.
    features_p50_ms_c1: float = 0.0
    features_rps: float = 0.0
    features_p50_ms: float = 0.0

    @property
    def rss_total_mib(self) -> float:
        return round(sum(self.rss_mib.values()), 1)

    @property
    def idle_cpu_total(self) -> float:
        return round(sum(self.idle_cpu_ms_per_s.values()), 1)


def _kind(spec: ResolvedSpec, name: str) -> str:
    """A process's kind, every Envoy (the edge's and each zone's) as one `envoy`."""
    kind = process_kind(spec, name)
    return "envoy" if kind.startswith(EDGE_PROXY) else kind


def _by_kind(mesh: Mesh, read: Callable[[int], float | None]) -> dict[str, float]:
    """By kind, the fork servers (which the mesh does not name) counted as `forkserver`."""
    found = sum_by_kind(mesh, read, _kind)
    for pid in mesh.supervisor.fork_server_pids().values():
        value = read(pid)
        if value is not None:
            found["forkserver"] = found.get("forkserver", 0.0) + value
    return found


def _rss_mib(pid: int) -> float | None:
    found = rss_bytes(pid)
    return None if found is None else found / 2**20


def arm_spec(spec: MeshSpec, arm: Arm) -> MeshSpec:
    """`spec` shaped as `arm`: a layout arm changes only `proxy.layout` (a small-host spec
    moves to the default profile first); small-host takes that profile's processes; exec
    is per_zone with no fork server; one-edge per_zone with one edge and no registry
    mirror; replicated per_zone with a replicated store (every other arm a single one)."""
    # One Redis in every arm but `replicated`, whatever the spec says (mesh.yaml runs a
    # replicated store), so each arm changes one thing against the others.
    topology = "replicated" if arm == "replicated" else "single"
    store = spec.feature_store.model_copy(update={"topology": topology})
    spec = spec.model_copy(update={"feature_store": store})
    if arm == "small-host":
        return spec if spec.profile == "small-host" else with_profile(spec, "small-host")
    if spec.profile != "default":
        spec = with_profile(spec, "default")
    if arm == "exec":
        processes = spec.processes.model_copy(update={"fork_server": False})
        spec = spec.model_copy(update={"processes": processes})
        arm = "per_zone"
    if arm == "one-edge":
        registry = spec.registry.model_copy(update={"mirrors": "none"})
        proxy = spec.proxy.model_copy(update={"layout": "per_zone", "edges": "one"})
        return spec.model_copy(update={"registry": registry, "proxy": proxy})
    if arm == "replicated":
        arm = "per_zone"
    return spec.model_copy(update={"proxy": spec.proxy.model_copy(update={"layout": arm})})


def measure_arm(
    spec: MeshSpec,
    arm: Arm,
    repeat: int,
    *,
    idle_s: float,
    seconds: float,
    concurrency: int,
    feature_concurrency: int = 64,
) -> LayoutRound:
    spec = arm_spec(spec, arm)
    with tempfile.TemporaryDirectory() as state:
        mesh = Mesh.from_spec(spec, Path(state))
        started = time.perf_counter()
        mesh.start()
        startup_s = time.perf_counter() - started
        startup_cpu_s = sum(filter(None, map(proc_cpu_seconds, descendants(os.getpid()))))
        try:
            wait_answering(mesh)
            time.sleep(SETTLE_S)
            rss = _by_kind(mesh, _rss_mib)
            processes = len(mesh.pids())
            before = _by_kind(mesh, proc_cpu_seconds)
            time.sleep(idle_s)
            after = _by_kind(mesh, proc_cpu_seconds)
            idle = {k: (after[k] - before.get(k, after[k])) / idle_s * 1e3 for k in after}
            target = predict_target(
                dial_every_edge(mesh.spec),
                model=sorted(mesh.spec.models)[0],
                entities=max(1, spec.demo.entities),
                timeout_s=CALL_TIMEOUT_S,
                metadata=bench_credentials(mesh.spec),
            )
            alone = measure(mesh, target, "edge", 1, seconds, repeat)
            loaded = measure(mesh, target, "edge", concurrency, seconds, repeat)
            # The first model's first view, every feature of it, as its gateway reads.
            view = mesh.spec.models[sorted(mesh.spec.models)[0]].views[0]
            reads = features_target(
                dial_mesh(mesh.spec, mesh.spec.zones[0]),
                view=view,
                features=mesh.spec.feature_views[view].features or [],
                entities=max(1, spec.demo.entities),
                timeout_s=CALL_TIMEOUT_S,
            )
            read_alone = measure(mesh, reads, "features", 1, seconds, repeat)
            read_loaded = measure(mesh, reads, "features", feature_concurrency, seconds, repeat)
        finally:
            mesh.stop()
    return LayoutRound(
        arm=arm,
        repeat=repeat,
        startup_s=round(startup_s, 2),
        startup_cpu_s=round(startup_cpu_s, 2),
        envoys=len(spec.proxies()),
        processes=processes,
        rss_mib={k: round(v, 1) for k, v in sorted(rss.items())},
        idle_cpu_ms_per_s={k: round(v, 1) for k, v in sorted(idle.items())},
        p50_ms_c1=alone.p50_ms,
        rps=loaded.rps,
        p99_ms=loaded.p99_ms,
        errors=alone.errors + loaded.errors + read_alone.errors + read_loaded.errors,
        features_p50_ms_c1=read_alone.p50_ms,
        features_rps=read_loaded.rps,
        features_p50_ms=read_loaded.p50_ms,
    )


# The figures compared, each read off a round: (name, reader, unit).
FIGURES: tuple[tuple[str, Callable[[LayoutRound], float], str], ...] = (
    ("start-up", lambda r: r.startup_s, "s"),
    ("start-up CPU", lambda r: r.startup_cpu_s, "s"),
    ("memory (RSS)", lambda r: r.rss_total_mib, "MiB"),
    ("Envoy memory", lambda r: r.rss_mib.get("envoy", 0.0), "MiB"),
    ("idle CPU", lambda r: r.idle_cpu_total, "ms/s"),
    ("Envoy idle CPU", lambda r: r.idle_cpu_ms_per_s.get("envoy", 0.0), "ms/s"),
    ("p50 at c=1", lambda r: r.p50_ms_c1, "ms"),
    ("req/s", lambda r: r.rps, ""),
    ("p99", lambda r: r.p99_ms, "ms"),
    ("GetFeatures p50 c=1", lambda r: r.features_p50_ms_c1, "ms"),
    ("GetFeatures req/s", lambda r: r.features_rps, ""),
    ("GetFeatures p50", lambda r: r.features_p50_ms, "ms"),
)


def summarize(rounds: Sequence[LayoutRound], arms: Sequence[Arm]) -> dict[str, object]:
    """Per figure: each arm's median, min and max over its repeats, and per later arm the
    per-repeat ratios to the first arm, with their median."""
    by_repeat: dict[int, dict[str, LayoutRound]] = {}
    for found in rounds:
        by_repeat.setdefault(found.repeat, {})[found.arm] = found
    complete = [r for _, r in sorted(by_repeat.items()) if all(arm in r for arm in arms)]
    base = arms[0]
    figures: dict[str, object] = {}
    for name, read, unit in FIGURES:
        entry: dict[str, object] = {"unit": unit}
        for arm in arms:
            values = [read(r) for r in rounds if r.arm == arm]
            entry[arm] = {
                "median": round(statistics.median(values), 2),
                "min": round(min(values), 2),
                "max": round(max(values), 2),
                "spread": round(spread(values), 3),
            }
        ratios: dict[str, object] = {}
        for arm in arms[1:]:
            per_repeat = [round(read(r[arm]) / read(r[base]), 3) for r in complete if read(r[base])]
            ratios[arm] = {
                "per_repeat": per_repeat,
                "median": round(statistics.median(per_repeat), 3) if per_repeat else None,
            }
        entry["ratios_to_first"] = ratios
        figures[name] = entry
    return figures


def bench_layout(
    spec: MeshSpec,
    *,
    arms: Sequence[Arm] = DEFAULT_ARMS,
    repeats: int = 3,
    idle_s: float = 10.0,
    seconds: float = 4.0,
    concurrency: int = 16,
    feature_concurrency: int = 64,
    progress: Callable[[LayoutRound], None] = lambda _: None,
) -> dict[str, object]:
    if len(arms) < 2 or len(set(arms)) != len(arms):
        raise UsageError(f"--arms: two or more different ones are compared, not {list(arms)}")
    spec = bench_spec(spec)
    rounds: list[LayoutRound] = []
    for repeat in range(repeats):
        # The order turns each repeat: a drift in the machine's speed favours no arm.
        shift = repeat % len(arms)
        for arm in list(arms[shift:]) + list(arms[:shift]):
            found = measure_arm(
                spec, arm, repeat, idle_s=idle_s, seconds=seconds, concurrency=concurrency,
                feature_concurrency=feature_concurrency,
            )  # fmt: skip
            progress(found)
            rounds.append(found)
    return {
        "arms": list(arms),
        "repeats": repeats,
        "idle_s": idle_s,
        "seconds": seconds,
        "concurrency": concurrency,
        "feature_concurrency": feature_concurrency,
        "rounds": [asdict(r) for r in rounds],
        "figures": summarize(rounds, arms),
    }


ARM_LABELS: dict[str, str] = {
    "shared": "one Envoy",
    "per_zone": "the edge's Envoy and one per zone",
    "small-host": "one feature and one model process for every zone, one Envoy",
    "exec": "per_zone, every Python service exec'd (no fork server)",
    "one-edge": "per_zone with one edge Envoy and no registry mirror",
    "replicated": "per_zone with a replicated feature store (a replica and a Sentinel per zone)",
}


def round_line(found: LayoutRound) -> str:
    return (
        f"  {found.arm:<10} #{found.repeat + 1}: start-up {found.startup_s:.2f} s "
        f"({found.startup_cpu_s:.1f} s of CPU), "
        f"{found.processes} processes ({found.envoys} Envoy), RSS "
        f"{found.rss_total_mib:.0f} MiB, idle {found.idle_cpu_total:.0f} ms/s, "
        f"p50 c=1 {found.p50_ms_c1:.2f} ms, {found.rps:.0f} req/s"
    )


def as_report(report: Mapping[str, object]) -> BenchReport:
    """The run for people: every figure of each arm, median (min-max), and each later
    arm's ratio to the first, per repeat."""
    figures = report["figures"]
    arms = report["arms"]
    assert isinstance(figures, dict) and isinstance(arms, list)
    base = arms[0]
    described = "; ".join(f"{arm}: {ARM_LABELS[arm]}" for arm in arms)
    shown = BenchReport(
        "servemesh bench layout",
        report,
        title=f"{described}. {report['repeats']} repeats, order turning; idle "
        f"{report['idle_s']} s, Predict c=1 and c={report['concurrency']}, GetFeatures c=1 "
        f"and c={report.get('feature_concurrency', 64)}, for {report['seconds']} s each",
    )
    header = f" {'figure':<21}" + "".join(f" {arm:>24}" for arm in arms)
    header += "".join(f"  {arm}/{base} (per repeat)" for arm in arms[1:])
    lines = [header]
    for name, entry in figures.items():
        label = f"{name} ({entry['unit']})" if entry["unit"] else name
        line = f" {label:<21}"
        for arm in arms:
            part = entry[arm]
            cell = f"{part['median']:.1f} ({part['min']:.1f}-{part['max']:.1f})"
            line += f" {cell:>24}"
        for arm in arms[1:]:
            ratio = entry["ratios_to_first"][arm]
            listed = ", ".join(f"{r:.2f}" for r in ratio["per_repeat"])
            median = "-" if ratio["median"] is None else f"{ratio['median']:.2f}x"
            line += f"  {median} ({listed})"
        lines.append(line)
    shown.note("\n".join(lines))
    return shown


def main(
    spec: str | None,
    *,
    arms: Sequence[Arm] = DEFAULT_ARMS,
    repeats: int,
    idle_seconds: float,
    seconds: float,
    concurrency: int,
    feature_concurrency: int = 64,
    quiet: bool = False,
) -> BenchReport:
    return as_report(
        bench_layout(
            load_spec(spec),
            arms=arms,
            repeats=repeats,
            idle_s=idle_seconds,
            seconds=seconds,
            concurrency=concurrency,
            feature_concurrency=feature_concurrency,
            progress=progress(quiet, round_line),
        )
    )
