"""`servemesh bench stream`: events/s end to end and event-to-prediction latency at a fixed
input rate, on a mesh of its own (free ports, a temp state dir).

Each round adds `rate` events a second for `seconds` to a stream the mesh's consumer
scores (through the gateways, or in process), waits until every one has its output, and
reads: input rate achieved, output rate (events / time from the first input to the last
output), p50/p99 event-to-prediction latency (the output entry's id less the input's: one
Redis clock), and that each event has exactly one output. Rounds alternate the modes;
every round is printed, then median and spread per mode.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import redis

from servemesh.bench.predict import one_zone_spec
from servemesh.bench.report import BenchReport, progress
from servemesh.contract.percentiles import percentile
from servemesh.launcher import Mesh
from servemesh.spec import MeshSpec, StreamSpec, load_spec
from servemesh.streams.keys import StreamKeys
from servemesh.streams.metrics import read_lag_now
from servemesh.streams.produce import delivery, produce

MODES: tuple[Literal["mesh", "in_process"], ...] = ("mesh", "in_process")
SETTLE_TIMEOUT_S = 120.0


def bench_spec(spec: MeshSpec, batch_size: int) -> MeshSpec:
    model = next(iter(sorted(spec.models)))
    return one_zone_spec(spec).model_copy(
        update={
            "streams": [
                StreamSpec(
                    name=f"bench-{mode.replace('_', '-')}",
                    model=model,
                    mode=mode,
                    batch_size=batch_size,
                )  # fmt: skip
                for mode in MODES
            ],
        }
    )


def one_round(
    client: Any, keys: StreamKeys, rate: float, seconds: float, entities: int
) -> dict[str, Any]:
    began = time.monotonic()
    ids = produce(client, keys, rate, seconds, entities)
    produced_s = time.monotonic() - began
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        lag = read_lag_now(client, keys)
        if lag is not None and lag.settled:
            break
        time.sleep(0.05)
    found = delivery(client, keys, ids)
    first_in = int(ids[0].split("-")[0])
    last_out = max(found.last_output_ms, first_in)
    span_s = max(0.001, (last_out - first_in) / 1000)
    return {
        "events": len(ids),
        "input_per_s": len(ids) / max(produced_s, 0.001),
        "output_per_s": len(found.outputs) / span_s,
        "p50_ms": percentile(found.latencies_ms, 50),
        "p99_ms": percentile(found.latencies_ms, 99),
        "max_ms": max(found.latencies_ms, default=0),
        "missing": found.missing,
        "duplicated": found.duplicated,
    }


def bench_stream(
    spec: MeshSpec, rate: float, seconds: float, repeats: int, batch_size: int,
    progress: Any = print,
) -> dict[str, Any]:  # fmt: skip
    spec = bench_spec(spec, batch_size)
    entities = max(1, spec.demo.entities)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as state:
        with Mesh.from_spec(spec, Path(state)) as mesh:
            client = redis.Redis.from_url(mesh.spec.redis_url, password=mesh.spec.redis_password())
            try:
                # A short warm-up per mode (connections, first batches), not measured.
                for stream in mesh.spec.streams:
                    one_round(client, StreamKeys.of(stream), rate, 1.0, entities)
                for repeat in range(repeats):
                    for stream in mesh.spec.streams:
                        found = one_round(client, StreamKeys.of(stream), rate, seconds, entities)
                        found.update(mode=stream.mode, repeat=repeat + 1)
                        rounds.append(found)
                        progress(found)
            finally:
                client.close()
    summary: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        mine = [r for r in rounds if r["mode"] == mode]
        summary[mode] = {
            key: {
                "median": statistics.median(r[key] for r in mine),
                "min": min(r[key] for r in mine),
                "max": max(r[key] for r in mine),
            }
            for key in ("output_per_s", "p50_ms", "p99_ms")
        }
        summary[mode]["exactly_once"] = all(not r["missing"] and not r["duplicated"] for r in mine)
    return {
        "rate": rate, "seconds": seconds, "repeats": repeats, "batch_size": batch_size,
        "rounds": rounds, "summary": summary,
    }  # fmt: skip


def _line(found: dict[str, Any]) -> str:
    return (
        f"  {found['mode']:<10} #{found['repeat']}: in {found['input_per_s']:.0f}/s, "
        f"out {found['output_per_s']:.0f}/s, p50 {found['p50_ms']:.0f} ms, "
        f"p99 {found['p99_ms']:.0f} ms, missing {found['missing']}, "
        f"duplicated {found['duplicated']}"
    )


def as_report(report: dict[str, Any]) -> BenchReport:
    """The run for people: each mode's events/s and latency, median (min-max), and
    whether every event was scored exactly once."""
    shown = BenchReport("servemesh bench stream", report)
    for mode, found in report["summary"].items():
        parts = []
        for key, label in (("output_per_s", "events/s"), ("p50_ms", "p50 ms"),
                           ("p99_ms", "p99 ms")):  # fmt: skip
            v = found[key]
            parts.append(f"{label} {v['median']:.0f} ({v['min']:.0f}-{v['max']:.0f})")
        once = "exactly once" if found["exactly_once"] else "NOT exactly once"
        shown.note(f"{mode:<10} median (min-max): " + ", ".join(parts) + f"; {once}")
    return shown


def main(
    spec: str | None,
    *,
    rate: float,
    seconds: float,
    repeats: int,
    batch_size: int,
    quiet: bool = False,
) -> BenchReport:
    if not quiet:
        print(f"stream bench: {rate:.0f} events/s for {seconds:.0f} s, {repeats} rounds per mode")
    show = progress(quiet, _line)
    return as_report(bench_stream(load_spec(spec), rate, seconds, repeats, batch_size, show))
