"""Benchmarks of a whole local mesh: start-up time and Predict latency, with and without Envoy.

Every figure comes from one run on one machine, so ratios between rows are meaningful even
on a noisy box; absolute numbers are not comparable across machines.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from servemesh.identity import Dial, dial_edge, dial_service
from servemesh.launcher import Mesh
from servemesh.load import ClosedLoop, closed_loop, predict_target, summarize
from servemesh.observe.top import MeshSnapshot, cost_between
from servemesh.proxy.apply import RouteManager
from servemesh.spec import MeshSpec, Ports, load_spec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class LoadResult:
    target: str
    concurrency: int
    requests: int  # answered in the measured window
    errors: int
    seconds: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    # CPU-seconds of every mesh process (services' own counters; Envoy, Redis from /proc)
    # per million successful predictions over the run, and its price (metrics.price_*).
    cpu_s_per_million: float | None = None
    price_per_million: float | None = None

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def measure_closed_loop(
    dial: Dial,
    target: str,
    concurrency: int,
    seconds: float,
    entities: int,
    warmup_s: float = 1.0,
) -> LoadResult:
    """`concurrency` callers each sending Predict back to back: `warmup_s`, then `seconds`
    measured (the callers run on from the warm-up into the measurement: no ramp-up dip)."""
    run = await closed_loop(
        predict_target(dial, entities=entities, timeout_s=5.0),
        ClosedLoop(workers=concurrency, duration_s=warmup_s + seconds),
    )
    summary = summarize(run.window(warmup_s, warmup_s + seconds), seconds)
    return LoadResult(
        target=target,
        concurrency=concurrency,
        requests=summary.ok,
        errors=summary.count - summary.ok,
        seconds=seconds,
        p50_ms=summary.p50_ms,
        p95_ms=summary.p95_ms,
        p99_ms=summary.p99_ms,
    )


def _with_cost(
    mesh: Mesh, dial: Dial, target: str, concurrency: int, seconds: float, entities: int
) -> LoadResult:
    """One closed-loop measurement, with the CPU the whole mesh spent on it."""
    before = MeshSnapshot.take(mesh.spec, mesh.pids())
    result = asyncio.run(measure_closed_loop(dial, target, concurrency, seconds, entities))
    cost = cost_between(before, MeshSnapshot.take(mesh.spec, mesh.pids()), mesh.spec).as_dict()
    per_million = cost["cpu_seconds_per_million"]
    price = cost["price_per_million"]
    return replace(
        result,
        cpu_s_per_million=per_million if isinstance(per_million, float) else None,
        price_per_million=price if isinstance(price, float) else None,
    )


def weight_change_times(mesh: Mesh, count: int) -> list[tuple[float, float]]:
    """Flip the first model's split between two versions `count` times.

    Per flip: (ms from the file swap to Envoy's admin API confirming the new config,
    ms from the start of the apply to the first Predict answered by the new version).
    """
    model_name, model = next(iter(sorted(mesh.spec.models.items())))
    first, second = sorted(model.versions)[:2]
    manager = RouteManager(mesh.paths)
    times = []
    with dial_edge(mesh.spec).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.PredictRequest(model=model_name, entity_ids=["user-0"])
        for flip in range(count):
            target = second if flip % 2 == 0 else first
            started = time.perf_counter()
            result = manager.set_weights(model_name, {target: 100})
            while stub.Predict(request, timeout=5).model_version != target:
                pass
            times.append((result.confirm_ms, (time.perf_counter() - started) * 1000))
    return times


def bench_predict(
    spec: MeshSpec,
    concurrencies: list[int],
    seconds: float,
    out_json: Path | None = None,
    weight_changes: int = 10,
) -> dict[str, object]:
    """Start a mesh, time its start, then load the edge (through Envoy) and a gateway directly."""
    # Free ports; no Prometheus, whose scrapes would take CPU from the mesh being measured.
    spec = spec.model_copy(
        update={
            "ports": Ports(edge=0, mesh=0, envoy_admin=0, services_base=0),
            "metrics": spec.metrics.model_copy(update={"prometheus": "off"}),
        }
    )
    with tempfile.TemporaryDirectory() as state:
        mesh = Mesh.from_spec(spec, Path(state))
        started = time.perf_counter()
        mesh.start()
        startup_s = time.perf_counter() - started
        try:
            entities = max(1, spec.demo.entities)
            gateway = next(i.name for i in mesh.spec.instances() if i.service == "gateway")
            targets = {
                "edge (Envoy -> gateway)": dial_edge(mesh.spec),
                "gateway direct": dial_service(mesh.spec, gateway),
            }
            results = [
                _with_cost(mesh, dial, name, c, seconds, entities)
                for c in concurrencies
                for name, dial in targets.items()
            ]
            changes = weight_change_times(mesh, weight_changes) if weight_changes else []
        finally:
            mesh.stop()
    report: dict[str, object] = {
        "startup_s": round(startup_s, 2),
        "results": [{**asdict(r), "rps": round(r.rps, 1)} for r in results],
    }
    if changes:
        report["weight_changes"] = {
            "count": len(changes),
            "confirm_ms_median": round(statistics.median(c[0] for c in changes), 1),
            "confirm_ms_max": round(max(c[0] for c in changes), 1),
            "effective_ms_median": round(statistics.median(c[1] for c in changes), 1),
            "effective_ms_max": round(max(c[1] for c in changes), 1),
        }
    if out_json:
        out_json.write_text(json.dumps(report, indent=2))
    return report


def print_report(report: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"mesh start-up: {report['startup_s']} s")
    table = Table(title="Predict, closed loop (one entity per call)")
    columns = ("target", "conc.", "req/s", "p50 ms", "p95 ms", "p99 ms", "errors", "vs direct")
    for column in (*columns, "CPU-s/1M", "$/1M"):
        table.add_column(column, justify="right" if column != "target" else "left")
    rows = report["results"]
    assert isinstance(rows, list)
    direct = {r["concurrency"]: r for r in rows if r["target"] == "gateway direct"}
    for r in rows:
        base = direct.get(r["concurrency"])
        ratio = f"{r['rps'] / base['rps']:.2f}x" if base and base["rps"] else ""
        table.add_row(
            r["target"],
            str(r["concurrency"]),
            f"{r['rps']:.0f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p95_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            str(r["errors"]),
            ratio,
            f"{r['cpu_s_per_million']:.0f}" if r.get("cpu_s_per_million") else "-",
            f"{r['price_per_million']:.4f}" if r.get("price_per_million") else "-",
        )
    console.print(table)
    changes = report.get("weight_changes")
    if isinstance(changes, dict):
        console.print(
            f"weight changes ({changes['count']}, idle mesh): swap to confirmed by Envoy "
            f"median {changes['confirm_ms_median']} ms (max {changes['confirm_ms_max']}); "
            f"apply start to first answer from the new version median "
            f"{changes['effective_ms_median']} ms (max {changes['effective_ms_max']})"
        )


def main(spec_path: str | None, concurrencies: list[int], seconds: float, out: str | None) -> int:
    report = bench_predict(load_spec(spec_path), concurrencies, seconds, Path(out) if out else None)
    print_report(report)
    print(json.dumps(report))
    return 0
