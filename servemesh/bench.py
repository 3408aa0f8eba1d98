"""Benchmarks of a whole local mesh: start-up time and Predict latency, with and without Envoy.

Every figure comes from one run on one machine, so ratios between rows are meaningful even
on a noisy box; absolute numbers are not comparable across machines.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from servemesh.launcher import Mesh
from servemesh.spec import MeshSpec, Ports, load_spec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class LoadResult:
    target: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p95_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def _percentile(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    index = min(len(sorted_ms) - 1, max(0, round(q * (len(sorted_ms) - 1))))
    return sorted_ms[index]


async def closed_loop(
    address: str,
    target: str,
    concurrency: int,
    seconds: float,
    entities: int,
    warmup_s: float = 1.0,
) -> LoadResult:
    """`concurrency` callers each sending Predict back to back for `seconds`."""
    latencies: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def caller(worker: int, until: float, record: bool) -> None:
            nonlocal errors
            i = worker
            while time.perf_counter() < until:
                request = gateway_pb2.PredictRequest(
                    model="fraud", entity_ids=[f"user-{i % entities}"]
                )
                started = time.perf_counter()
                try:
                    await stub.Predict(request, timeout=5)
                    if record:
                        latencies.append((time.perf_counter() - started) * 1000)
                except grpc.aio.AioRpcError:
                    if record:
                        errors += 1
                i += concurrency

        warm_until = time.perf_counter() + warmup_s
        await asyncio.gather(*(caller(w, warm_until, False) for w in range(concurrency)))
        started = time.perf_counter()
        until = started + seconds
        await asyncio.gather(*(caller(w, until, True) for w in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return LoadResult(
        target=target,
        concurrency=concurrency,
        requests=len(latencies),
        errors=errors,
        seconds=elapsed,
        p50_ms=_percentile(latencies, 0.50),
        p95_ms=_percentile(latencies, 0.95),
        p99_ms=_percentile(latencies, 0.99),
    )


def bench_predict(
    spec: MeshSpec, concurrencies: list[int], seconds: float, out_json: Path | None = None
) -> dict[str, object]:
    """Start a mesh, time its start, then load the edge (through Envoy) and a gateway directly."""
    spec = spec.model_copy(update={"ports": Ports(edge=0, mesh=0, envoy_admin=0, services_base=0)})
    with tempfile.TemporaryDirectory() as state:
        mesh = Mesh.from_spec(spec, Path(state))
        started = time.perf_counter()
        mesh.start()
        startup_s = time.perf_counter() - started
        try:
            entities = max(1, spec.demo.entities)
            targets = {
                "edge (Envoy -> gateway)": mesh.spec.edge_address,
                "gateway direct": mesh.spec.address_of(
                    next(i.name for i in mesh.spec.instances() if i.service == "gateway")
                ),
            }
            results = [
                asyncio.run(closed_loop(address, name, c, seconds, entities))
                for c in concurrencies
                for name, address in targets.items()
            ]
        finally:
            mesh.stop()
    report = {
        "startup_s": round(startup_s, 2),
        "results": [{**asdict(r), "rps": round(r.rps, 1)} for r in results],
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
    for column in ("target", "conc.", "req/s", "p50 ms", "p95 ms", "p99 ms", "errors", "vs direct"):
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
        )
    console.print(table)


def main(spec_path: str | None, concurrencies: list[int], seconds: float, out: str | None) -> int:
    report = bench_predict(load_spec(spec_path), concurrencies, seconds, Path(out) if out else None)
    print_report(report)
    print(json.dumps(report))
    return 0
