"""What observability costs, and how soon a trace can be read: `servemesh bench observe`.

Two budgets, measured in one run on one machine:

1. Throughput: tracing at the spec's sampling ratio plus the prediction log together cost at
   most 10% of Predict throughput at concurrency 64, against the same mesh with both off.
   Two meshes start from the same spec, one "observed" (both on) and one "off" (with
   `--split`, also one with tracing only and one with the log only); the closed loop goes
   through each edge in turn, the order rotated every repeat (a machine whose speed drifts
   during the run favours no mesh), while every other mesh is paused (SIGSTOP: an idle
   mesh's timers would take CPU from the one measured, and the observed mesh's more than
   the off one's). Each mesh's CPU per Predict is read from /proc for every process it runs.
2. Freshness: a sampled Predict's trace is queryable in the trace store (what
   `servemesh trace` reads) within 2 s of the answer. Sampled Predicts (a `traceparent`
   with the sampled flag, as `servemesh predict --trace` sends) go to the observed mesh one
   at a time, idle and under an open-loop load, and the store is polled until the request
   id finds its trace, and until every hop's spans are there.
"""

from __future__ import annotations

import asyncio
import math
import signal
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from servemesh.bench.report import BenchReport
from servemesh.contract.wire import GATEWAY_SERVICE, OIP_SERVICE, TRACE_HEADERS
from servemesh.identity import dial_every_edge
from servemesh.launcher import Mesh
from servemesh.load import BackgroundLoad, ClosedLoop, closed_loop, predict_target, summarize
from servemesh.observe.cpu import proc_cpu_seconds
from servemesh.spec import MeshSpec, Ports, ResolvedSpec, load_spec
from servemesh.state.credentials import EdgeAuthMetadata
from servemesh.tracestore.receiver import store_path
from servemesh.tracestore.store import SpanRecord, TraceStore
from servemesh.tracestore.traceparent import new_traceparent
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

OBSERVED = "observed"
OFF = "off"
TRACING_ONLY = "tracing only"
LOG_ONLY = "log only"
# The budgets.
THROUGHPUT_BUDGET = 0.10  # the observed mesh may lose at most this share of req/s
FRESHNESS_BUDGET_S = 2.0  # answer to trace in the store
# How often the store is asked while a probe waits for its trace, and for how long.
POLL_S = 0.01
PROBE_TIMEOUT_S = 15.0
# Each measurement's callers run this long before the measured window (no ramp-up dip);
# longer for a mesh just continued: measured at once, the observed mesh was 10-20% slower
# in the rounds right after a pause than in the rounds without one (its catch-up on
# timers, exports and flushes), the off mesh not.
WARMUP_S = 1.0
RESUMED_WARMUP_S = 5.0


# --- the two meshes ------------------------------------------------------------------------


def arm_specs(spec: MeshSpec, split: bool = False) -> dict[str, MeshSpec]:
    """The observed and the off mesh of `spec` (and with `split`, one with tracing only and
    one with the log only): free ports, no Prometheus (its scrapes would take CPU from the
    mesh measured), tracing at the spec's sampling ratio."""
    base = spec.model_copy(
        update={
            "ports": Ports.free(),
            "metrics": spec.metrics.model_copy(update={"prometheus": "off"}),
        }
    )

    def arm(tracing: bool, log: bool) -> MeshSpec:
        return base.model_copy(
            update={
                "tracing": base.tracing.model_copy(update={"enabled": tracing}),
                "prediction_log": base.prediction_log.model_copy(update={"enabled": log}),
            }
        )

    arms = {OBSERVED: arm(True, True), OFF: arm(False, False)}
    if split:
        arms |= {TRACING_ONLY: arm(True, False), LOG_ONLY: arm(False, True)}
    return arms


def process_kind(spec: ResolvedSpec, name: str) -> str:
    """gateway, feature, model, registry for services; envoy, redis, tracestore as named."""
    services = {i.name: i.service for i in spec.instances()}
    return services.get(name, name)


def sum_by_kind(
    mesh: Mesh,
    read: Callable[[int], float | None],
    kind_of: Callable[[ResolvedSpec, str], str] = process_kind,
) -> dict[str, float]:
    """`read(pid)` of every running process of `mesh` (None: gone), summed by kind."""
    found: dict[str, float] = {}
    for name, pid in mesh.pids().items():
        value = read(pid)
        if value is not None:
            kind = kind_of(mesh.spec, name)
            found[kind] = found.get(kind, 0.0) + value
    return found


def cpu_by_kind(mesh: Mesh) -> dict[str, float]:
    """CPU seconds (user + system) of every running process of `mesh`, summed by kind."""
    return sum_by_kind(mesh, proc_cpu_seconds)


# --- budget 1: throughput --------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """One closed-loop measurement of one arm."""

    arm: str
    repeat: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    # CPU ms per successful Predict, by process kind (this arm's processes only).
    cpu_ms: dict[str, float]
    # Failed calls by status.
    codes: dict[str, int] = field(default_factory=dict)
    # Whether the mesh was paused for the round before this one.
    resumed: bool = False


@contextmanager
def paused(meshes: list[Mesh]) -> Iterator[None]:
    """Every process of `meshes` stopped (SIGSTOP) meanwhile, then continued."""
    stopped: list[tuple[Mesh, str]] = []
    try:
        for mesh in meshes:
            for name in mesh.pids():
                mesh.send_signal(name, signal.SIGSTOP)
                stopped.append((mesh, name))
        yield
    finally:
        for mesh, name in stopped:
            mesh.send_signal(name, signal.SIGCONT)


# Predicts in a row a mesh must answer before it is measured: one just continued catches up
# on its timers first (Envoy's health checks, keepalives), and a lone success was seen
# followed by a burst of failures.
SETTLED_CALLS = 50
# The subject of the token a benchmark signs for its calls at the edge (jwt edge auth).
BENCH_CALLER = "servemesh-bench"


def bench_credentials(spec: ResolvedSpec) -> Callable[[], list[tuple[str, str]]]:
    """What a benchmark's calls send at the edge: the credentials its auth mode asks for
    (a token the bench signs for itself, renewed before it expires; the basic key)."""
    return EdgeAuthMetadata(spec, BENCH_CALLER).metadata


def wait_answering(mesh: Mesh, timeout_s: float = 60.0) -> None:
    """Until SETTLED_CALLS Predicts in a row through the edge are answered (of the spec's
    first model by name, the one every bench measures)."""
    deadline = time.monotonic() + timeout_s
    in_a_row = 0
    model = next(iter(sorted(mesh.spec.models)))
    credentials = bench_credentials(mesh.spec)
    with dial_every_edge(mesh.spec).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.PredictRequest(model=model, entity_ids=["user-0"])
        while in_a_row < SETTLED_CALLS:
            try:
                stub.Predict(request, timeout=2, metadata=credentials())
                in_a_row += 1
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                in_a_row = 0
                time.sleep(0.05)


def measure_round(
    arm: str, repeat: int, mesh: Mesh, concurrency: int, seconds: float, resumed: bool
) -> Round:
    entities = max(1, mesh.spec.demo.entities)
    warmup_s = RESUMED_WARMUP_S if resumed else WARMUP_S
    wait_answering(mesh)
    before, started = cpu_by_kind(mesh), time.monotonic()
    run = asyncio.run(
        closed_loop(
            predict_target(
                dial_every_edge(mesh.spec),
                entities=entities,
                timeout_s=5.0,
                metadata=bench_credentials(mesh.spec),
            ),
            ClosedLoop(workers=concurrency, duration_s=warmup_s + seconds),
        )
    )
    after, elapsed = cpu_by_kind(mesh), time.monotonic() - started
    measured = run.window(warmup_s, warmup_s + seconds)
    summary = summarize(measured, seconds)
    # The warm-up's calls are not counted: scale the CPU to the measured window.
    answered = summary.ok * elapsed / seconds
    cpu_ms = {
        kind: round((after[kind] - before.get(kind, after[kind])) / answered * 1000, 3)
        for kind in sorted(after)
        if answered
    }
    return Round(
        arm=arm,
        repeat=repeat,
        rps=round(summary.ok / seconds, 1),
        p50_ms=round(summary.p50_ms, 2),
        p99_ms=round(summary.p99_ms, 2),
        errors=summary.count - summary.ok,
        cpu_ms=cpu_ms,
        codes=dict(Counter(o.code for o in measured if not o.ok)),
        resumed=resumed,
    )


# --- budget 2: freshness ---------------------------------------------------------------------

# What a Predict's whole trace holds: (service, span) pairs, and how many Envoy mesh-listener
# spans (one per downstream call).
WHOLE_TRACE = frozenset(
    {
        ("envoy-edge", "ingress"),
        ("gateway", f"{GATEWAY_SERVICE}/Predict"),
        ("feature", "redis MGET"),
        ("model", f"{OIP_SERVICE}/ModelInfer"),
        ("model", "batch"),
    }
)
MESH_HOPS = 2


def is_whole(spans: list[SpanRecord]) -> bool:
    """Every hop of a Predict is in `spans` (services and Envoy export separately)."""
    names = {(s.service, s.name) for s in spans}
    meshes = sum(1 for s in spans if s.service.startswith("envoy-mesh-"))
    return WHOLE_TRACE <= names and meshes >= MESH_HOPS


@dataclass(frozen=True)
class Probe:
    """One sampled Predict: seconds from its answer until the store had its trace."""

    findable_s: float  # `servemesh trace REQUEST_ID` finds the trace (NaN: never)
    whole_s: float  # ... and it holds every hop (NaN: never within PROBE_TIMEOUT_S)


def probe(
    stub: gateway_pb2_grpc.GatewayStub,
    store: TraceStore,
    entity: str,
    credentials: Sequence[tuple[str, str]] = (),
) -> Probe:
    traceparent, trace_id = new_traceparent()
    reply = stub.Predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=[entity]),
        timeout=5,
        metadata=[*credentials, (TRACE_HEADERS[0], traceparent)],
    )
    answered = time.perf_counter()
    findable = whole = math.nan
    while time.perf_counter() - answered < PROBE_TIMEOUT_S:
        now = time.perf_counter() - answered
        if math.isnan(findable) and store.find(reply.request_id) == trace_id:
            findable = now
        if not math.isnan(findable) and is_whole(store.trace(trace_id)):
            whole = now
            break
        time.sleep(POLL_S)
    return Probe(findable, whole)


def freshness(mesh: Mesh, probes: int, load_rps: float) -> list[Probe]:
    """`probes` sampled Predicts one after another, with `load_rps` of unsampled open-loop
    load beside them (0: an idle mesh)."""
    entities = max(1, mesh.spec.demo.entities)
    dial = dial_every_edge(mesh.spec)
    credentials = bench_credentials(mesh.spec)
    with ExitStack() as stack:
        if load_rps > 0:
            target = predict_target(dial, entities=entities, timeout_s=5.0, metadata=credentials)
            load = BackgroundLoad(target, rate_per_s=load_rps)
            load.start()
            stack.callback(load.stop)
        store = TraceStore(store_path(mesh.state_dir))
        stack.callback(store.close)
        channel = stack.enter_context(dial.channel())
        stub = gateway_pb2_grpc.GatewayStub(channel)
        grpc.channel_ready_future(channel).result(timeout=10)
        return [probe(stub, store, f"user-{i % entities}", credentials()) for i in range(probes)]


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Report:
    date: str
    concurrency: int
    seconds: float
    repeats: int
    sample_ratio: float
    export_interval_ms: int
    arms: list[str] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    probes: dict[str, list[Probe]] = field(default_factory=dict)

    def arm(self, name: str) -> list[Round]:
        return [r for r in self.rounds if r.arm == name]

    def ratios(self, name: str = OBSERVED) -> list[float]:
        """`name`'s req/s over the off mesh's, repeat by repeat (each repeat measured every
        mesh once, back to back)."""
        off = {r.repeat: r.rps for r in self.arm(OFF)}
        return [r.rps / off[r.repeat] for r in self.arm(name) if off.get(r.repeat)]

    def summary(self) -> dict[str, object]:
        arms: dict[str, dict[str, Any]] = {}
        for name in self.arms:
            rounds = self.arm(name)
            rps = [r.rps for r in rounds]
            kinds = sorted({k for r in rounds for k in r.cpu_ms})
            arms[name] = {
                "rps": rps,
                "rps_median": round(statistics.median(rps), 1),
                "rps_min": min(rps),
                "rps_max": max(rps),
                "p50_ms_median": round(statistics.median(r.p50_ms for r in rounds), 2),
                "p99_ms_median": round(statistics.median(r.p99_ms for r in rounds), 2),
                "errors": sum(r.errors for r in rounds),
                "error_codes": dict(sum((Counter(r.codes) for r in rounds), Counter())),
                "cpu_ms_per_predict": {
                    k: round(statistics.median(r.cpu_ms.get(k, 0.0) for r in rounds), 3)
                    for k in kinds
                },
            }
            if name != OFF:
                ratios = self.ratios(name)
                arms[name]["ratio_per_repeat"] = [round(r, 3) for r in ratios]
                arms[name]["ratio_median"] = round(statistics.median(ratios), 3)
        observed, off = arms[OBSERVED], arms[OFF]
        ratio = observed["rps_median"] / off["rps_median"]
        paired = statistics.median(self.ratios())
        out: dict[str, object] = {
            "date": self.date,
            "concurrency": self.concurrency,
            "seconds": self.seconds,
            "repeats": self.repeats,
            "sample_ratio": self.sample_ratio,
            "export_interval_ms": self.export_interval_ms,
            "arms": arms,
            "ratio_of_medians": round(ratio, 3),
            "ratio_per_repeat": [round(r, 3) for r in self.ratios()],
            "ratio_median_of_repeats": round(paired, 3),
            # The worse of the two readings counts.
            "throughput_cost": round(1 - min(ratio, paired), 3),
            "throughput_budget_met": 1 - min(ratio, paired) <= THROUGHPUT_BUDGET,
            "freshness": {k: _delays(v) for k, v in self.probes.items()},
        }
        found = [p for v in self.probes.values() for p in v]
        out["freshness_budget_met"] = bool(found) and all(
            p.whole_s <= FRESHNESS_BUDGET_S for p in found
        )
        return out


def _delays(probes: list[Probe]) -> dict[str, object]:
    def stats(values: list[float]) -> dict[str, object]:
        seen = sorted(v for v in values if not math.isnan(v))
        return {
            "n": len(values),
            "missing": len(values) - len(seen),
            "median_s": round(statistics.median(seen), 3) if seen else None,
            "max_s": round(seen[-1], 3) if seen else None,
            "all_s": [round(v, 3) for v in seen],
        }

    return {
        "findable": stats([p.findable_s for p in probes]),
        "whole": stats([p.whole_s for p in probes]),
    }


@contextmanager
def _meshes(specs: Mapping[str, MeshSpec]) -> Iterator[dict[str, Mesh]]:
    with tempfile.TemporaryDirectory() as state, ExitStack() as stack:
        meshes = {}
        for name, spec in specs.items():
            mesh = Mesh.from_spec(spec, Path(state) / name)
            stack.enter_context(mesh)  # started; stopped by PID on the way out
            meshes[name] = mesh
        yield meshes


def bench_observe(
    spec: MeshSpec,
    *,
    concurrency: int = 64,
    seconds: float = 10.0,
    repeats: int = 3,
    probes: int = 10,
    probe_load_share: float = 0.5,
    split: bool = False,
) -> Report:
    specs = arm_specs(spec, split)
    report = Report(
        date=time.strftime("%Y-%m-%d"),
        concurrency=concurrency,
        seconds=seconds,
        repeats=repeats,
        sample_ratio=spec.tracing.sample_ratio,
        export_interval_ms=spec.tracing.export_interval_ms,
        arms=list(specs),
    )
    with _meshes(specs) as meshes:
        names = list(meshes)
        last = ""
        for repeat in range(repeats):
            # Rotated each repeat: every mesh takes every place in turn (two meshes: AB BA).
            shift = repeat % len(names)
            for arm in names[shift:] + names[:shift]:
                others = [m for name, m in meshes.items() if name != arm]
                with paused(others):
                    report.rounds.append(
                        measure_round(
                            arm, repeat, meshes[arm], concurrency, seconds, resumed=arm != last
                        )
                    )
                last = arm
        if probes:
            observed = meshes[OBSERVED]
            load = probe_load_share * statistics.median(r.rps for r in report.arm(OBSERVED))
            with paused([m for name, m in meshes.items() if name != OBSERVED]):
                report.probes["idle"] = freshness(observed, probes, 0.0)
                report.probes[f"under {load:.0f} req/s"] = freshness(observed, probes, load)
    return report


def as_report(summary: Mapping[str, object]) -> BenchReport:
    """The run for people: each mesh's req/s and latency, the CPU by process kind, the
    throughput budget and how soon the sampled traces could be read."""
    shown = BenchReport("servemesh bench observe", summary)
    arms = summary["arms"]
    assert isinstance(arms, dict)
    table = shown.table(
        f"Predict through the edge, closed loop c={summary['concurrency']}, "
        f"{summary['seconds']:g} s x {summary['repeats']} per mesh",
        ("mesh", "req/s median", "min-max", "vs off", "p50 ms", "p99 ms", "errors", "CPU ms"),
        left={"mesh"},
    )
    for name, arm in arms.items():
        table.add_row(
            name,
            f"{arm['rps_median']:.0f}",
            f"{arm['rps_min']:.0f}-{arm['rps_max']:.0f}",
            f"{arm['ratio_median']:.3f}" if "ratio_median" in arm else "",
            f"{arm['p50_ms_median']:.1f}",
            f"{arm['p99_ms_median']:.1f}",
            str(arm["errors"]),
            f"{sum(arm['cpu_ms_per_predict'].values()):.2f}",
        )
    for name, arm in arms.items():
        if arm["errors"]:
            shown.note(f"failed calls of {name}: {arm['error_codes']}")
    cpu = shown.table(
        "CPU ms per Predict by process kind (median of the repeats)",
        ("process", *arms, "observed - off"),
        left={"process"},
    )
    by_arm = {name: arm["cpu_ms_per_predict"] for name, arm in arms.items()}
    for kind in sorted({k for used in by_arm.values() for k in used}):
        a, b = by_arm[OBSERVED].get(kind, 0.0), by_arm[OFF].get(kind, 0.0)
        cells = [f"{used.get(kind, 0.0):.3f}" for used in by_arm.values()]
        cpu.add_row(kind, *cells, f"{a - b:+.3f}")
    met = "met" if summary["throughput_budget_met"] else "MISSED"
    shown.note(
        f"observed/off req/s: {summary['ratio_of_medians']:.3f} (of the medians), "
        f"{summary['ratio_median_of_repeats']:.3f} (median of the repeats' ratios "
        f"{summary['ratio_per_repeat']}); cost {summary['throughput_cost']:.1%} (the worse), "
        f"budget {THROUGHPUT_BUDGET:.0%}: {met}"
    )
    freshness = summary["freshness"]
    assert isinstance(freshness, dict)
    for phase, delays in freshness.items():
        for what, seen in delays.items():
            shown.note(
                f"trace {what} after the answer ({phase}): median {seen['median_s']} s, "
                f"max {seen['max_s']} s, missing {seen['missing']} of {seen['n']}"
            )
    if freshness:
        met = "met" if summary["freshness_budget_met"] else "MISSED"
        shown.note(f"whole trace within {FRESHNESS_BUDGET_S:g} s of every answer: {met}")
    return shown


def main(
    spec: str | None,
    *,
    concurrency: int,
    seconds: float,
    repeats: int,
    probes: int,
    split: bool,
) -> BenchReport:
    report = bench_observe(
        load_spec(spec),
        concurrency=concurrency,
        seconds=seconds,
        repeats=repeats,
        probes=probes,
        split=split,
    )
    summary = report.summary()
    summary["rounds"] = [asdict(r) for r in report.rounds]
    return as_report(summary)
