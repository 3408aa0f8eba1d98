"""`servemesh bench layout`: what an Envoy per zone costs against one shared Envoy, in one run.

For each repeat, the order turning, one mesh of the spec per layout (`proxy.layout` shared,
then per_zone, or the other way round), on free ports, Prometheus off (both sides alike):

- start-up: `Mesh.start()` until every service is SERVING and the edge answers;
- memory: the resident set (VmRSS) of every process the mesh started, summed by kind
  (every Envoy counts as `envoy`), once Predicts are answered and the mesh has sat idle a
  moment;
- idle CPU: user + system CPU of those processes over `idle_s` with no traffic, in ms/s;
- Predict through the edge at c=1 (p50) and at c=`concurrency` (req/s), `seconds` each.

The launcher runs inside this process in both arms, so its own memory is left out of both.
Each figure is the median of its repeats with min-max; the ratios per_zone / shared are
taken per repeat, from the two meshes measured back to back.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from servemesh.bench import CALL_TIMEOUT_S, bench_spec, measure
from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.load import predict_target
from servemesh.load.stats import spread
from servemesh.observe.cpu import proc_cpu_seconds, rss_bytes
from servemesh.observe_bench import process_kind, sum_by_kind, wait_answering
from servemesh.spec import EDGE_PROXY, MeshSpec, ResolvedSpec, load_spec

Layout = Literal["shared", "per_zone"]
LAYOUTS: tuple[Layout, Layout] = ("shared", "per_zone")
# Idle before memory is read: the first health-check rounds and lazy imports are done.
SETTLE_S = 2.0


@dataclass(frozen=True)
class LayoutRound:
    """One mesh of one layout, measured once."""

    layout: Layout
    repeat: int
    startup_s: float
    envoys: int
    rss_mib: dict[str, float]  # by kind
    idle_cpu_ms_per_s: dict[str, float]  # by kind
    p50_ms_c1: float
    rps: float  # at the round's concurrency
    p99_ms: float
    errors: int

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
    return sum_by_kind(mesh, read, _kind)


def _rss_mib(pid: int) -> float | None:
    found = rss_bytes(pid)
    return None if found is None else found / 2**20


def measure_layout(
    spec: MeshSpec, layout: Layout, repeat: int, *, idle_s: float, seconds: float, concurrency: int
) -> LayoutRound:
    spec = spec.model_copy(update={"proxy": spec.proxy.model_copy(update={"layout": layout})})
    with tempfile.TemporaryDirectory() as state:
        mesh = Mesh.from_spec(spec, Path(state))
        started = time.perf_counter()
        mesh.start()
        startup_s = time.perf_counter() - started
        try:
            wait_answering(mesh)
            time.sleep(SETTLE_S)
            rss = _by_kind(mesh, _rss_mib)
            before = _by_kind(mesh, proc_cpu_seconds)
            time.sleep(idle_s)
            after = _by_kind(mesh, proc_cpu_seconds)
            idle = {k: (after[k] - before.get(k, after[k])) / idle_s * 1e3 for k in after}
            target = predict_target(
                dial_edge(mesh.spec),
                model=sorted(mesh.spec.models)[0],
                entities=max(1, spec.demo.entities),
                timeout_s=CALL_TIMEOUT_S,
            )
            alone = measure(mesh, target, "edge", 1, seconds, repeat)
            loaded = measure(mesh, target, "edge", concurrency, seconds, repeat)
        finally:
            mesh.stop()
    return LayoutRound(
        layout=layout,
        repeat=repeat,
        startup_s=round(startup_s, 2),
        envoys=len(spec.proxies()),
        rss_mib={k: round(v, 1) for k, v in sorted(rss.items())},
        idle_cpu_ms_per_s={k: round(v, 1) for k, v in sorted(idle.items())},
        p50_ms_c1=alone.p50_ms,
        rps=loaded.rps,
        p99_ms=loaded.p99_ms,
        errors=alone.errors + loaded.errors,
    )


# The figures compared, each read off a round: (name, reader, unit).
FIGURES: tuple[tuple[str, Callable[[LayoutRound], float], str], ...] = (
    ("start-up", lambda r: r.startup_s, "s"),
    ("memory (RSS)", lambda r: r.rss_total_mib, "MiB"),
    ("Envoy memory", lambda r: r.rss_mib.get("envoy", 0.0), "MiB"),
    ("idle CPU", lambda r: r.idle_cpu_total, "ms/s"),
    ("Envoy idle CPU", lambda r: r.idle_cpu_ms_per_s.get("envoy", 0.0), "ms/s"),
    ("p50 at c=1", lambda r: r.p50_ms_c1, "ms"),
    ("req/s", lambda r: r.rps, ""),
    ("p99", lambda r: r.p99_ms, "ms"),
)


def summarize(rounds: Sequence[LayoutRound]) -> dict[str, object]:
    """Per figure: each layout's median, min and max over its repeats, and the per-repeat
    ratios per_zone / shared with their median."""
    by_repeat: dict[int, dict[str, LayoutRound]] = {}
    for found in rounds:
        by_repeat.setdefault(found.repeat, {})[found.layout] = found
    pairs = [pair for _, pair in sorted(by_repeat.items()) if len(pair) == len(LAYOUTS)]
    figures: dict[str, object] = {}
    for name, read, unit in FIGURES:
        entry: dict[str, object] = {"unit": unit}
        for layout in LAYOUTS:
            values = [read(r) for r in rounds if r.layout == layout]
            entry[layout] = {
                "median": round(statistics.median(values), 2),
                "min": round(min(values), 2),
                "max": round(max(values), 2),
                "spread": round(spread(values), 3),
            }
        ratios = [
            round(read(p["per_zone"]) / read(p["shared"]), 3) for p in pairs if read(p["shared"])
        ]
        entry["ratios"] = ratios
        entry["ratio_median"] = round(statistics.median(ratios), 3) if ratios else None
        figures[name] = entry
    return figures


def bench_layout(
    spec: MeshSpec,
    *,
    repeats: int = 3,
    idle_s: float = 10.0,
    seconds: float = 4.0,
    concurrency: int = 16,
    progress: Callable[[LayoutRound], None] = lambda _: None,
) -> dict[str, object]:
    spec = bench_spec(spec)
    rounds: list[LayoutRound] = []
    for repeat in range(repeats):
        order = LAYOUTS if repeat % 2 == 0 else LAYOUTS[::-1]
        for layout in order:
            found = measure_layout(
                spec, layout, repeat, idle_s=idle_s, seconds=seconds, concurrency=concurrency
            )
            progress(found)
            rounds.append(found)
    return {
        "repeats": repeats,
        "idle_s": idle_s,
        "seconds": seconds,
        "concurrency": concurrency,
        "rounds": [asdict(r) for r in rounds],
        "figures": summarize(rounds),
    }


def print_report(report: Mapping[str, object]) -> None:
    figures = report["figures"]
    assert isinstance(figures, dict)
    print(
        f"shared (one Envoy) vs per_zone (the edge's and one per zone), {report['repeats']} "
        f"repeats, order turning; idle {report['idle_s']} s, Predict c=1 and "
        f"c={report['concurrency']} for {report['seconds']} s each"
    )
    print(f" {'figure':<20} {'shared':>24} {'per_zone':>24}  per_zone/shared (per repeat)")
    for name, entry in figures.items():
        cells = []
        for layout in LAYOUTS:
            part = entry[layout]
            cells.append(f"{part['median']:.1f} ({part['min']:.1f}-{part['max']:.1f})")
        ratios = ", ".join(f"{r:.2f}" for r in entry["ratios"])
        label = f"{name} ({entry['unit']})" if entry["unit"] else name
        print(
            f" {label:<20} {cells[0]:>24} {cells[1]:>24}  {entry['ratio_median']:.2f}x ({ratios})"
        )


def main(
    spec_path: str | None,
    *,
    repeats: int,
    idle_s: float,
    seconds: float,
    concurrency: int,
    json_out: str | None,
    as_json: bool,
) -> int:
    def show(found: LayoutRound) -> None:
        if not as_json:
            print(
                f"  {found.layout:<8} #{found.repeat + 1}: start-up {found.startup_s:.2f} s, "
                f"{found.envoys} Envoy(s), RSS {found.rss_total_mib:.0f} MiB, idle "
                f"{found.idle_cpu_total:.0f} ms/s, p50 c=1 {found.p50_ms_c1:.2f} ms, "
                f"{found.rps:.0f} req/s",
                flush=True,
            )

    report = bench_layout(
        load_spec(spec_path),
        repeats=repeats,
        idle_s=idle_s,
        seconds=seconds,
        concurrency=concurrency,
        progress=show,
    )
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2))
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0
