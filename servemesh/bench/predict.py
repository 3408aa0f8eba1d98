"""`servemesh bench predict`: Predict through the whole mesh against its own model server
alone, in one run, with the CPU every process kind spends per answer.

One mesh starts from the spec (tracing at its sampling ratio and the prediction log as the
spec sets them; Prometheus off, whose scrapes would take CPU from the mesh measured). At each
concurrency, in turn and `repeats` times:

- "edge": Predict for one entity per call through the edge Envoy (edge Envoy, gateway, mesh
  Envoy, feature service and Redis, model server);
- "model alone": ModelInfer for one row sent straight to one model replica, with the same
  client: what the mesh's own model server does without the mesh around it;
- "echo": the same ModelInfer bodies to the echo server (`servemesh.bench.model.targets
  echo`: the services' gRPC server stack answering with no work, plaintext), started by the
  run beside the mesh: what one Python gRPC call costs at best.

Before the load, the mesh sits idle for `idle_s`: its CPU over that time (ms/s) and its
memory (RSS) by process kind are read from /proc. The ratios the second fast-path issue
sets (TARGETS) are computed from this one run: mesh CPU per Predict over the echo's CPU per
call at c=64, edge req/s over model-alone req/s at c=64, edge p50 over model-alone p50 at
c=1, the idle CPU, the edge's p99 at c=64 and the memory.

With `model="heavy"` the spec's models are replaced by the compute-bound bench model
(`model_bench.models`: 64 -> 2048 -> 2048 -> 1, torch.export, on the first model's feature
view), and the one target is the mesh's share of its model server alone at c=64
(TARGET_HEAVY_RPS_OVER_ALONE_C64): where the model costs real compute, the mesh around it
should cost little.

The two are measured back to back each repeat, so their ratio comes from one run on one
machine. Every row is the median of its repeats with min-max; a row whose spread exceeds
SPREAD_LIMIT is measured once more, and flagged if it stays wide. The CPU per answer is read
from /proc for every process of the mesh (user + system), summed by kind (envoy, gateway,
feature, model, redis, registry, tracestore), plus the client's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from servemesh.bench import h2load as bench_h2load
from servemesh.bench.observe import BENCH_CALLER, cpu_by_kind, sum_by_kind, wait_answering
from servemesh.bench.report import BenchReport, progress
from servemesh.contract.errors import UsageError
from servemesh.contract.wire import AUTHORIZATION_HEADER, OIP_SERVICE
from servemesh.identity import Dial, dial_address, dial_edge, dial_every_edge, dial_service
from servemesh.identity.enroll import BENCH_ECHO_IDENTITY, enrolled
from servemesh.launcher import Mesh
from servemesh.load import ClosedLoop, Target, closed_loop, predict_target, summarize
from servemesh.load.outcome import Reply, Request
from servemesh.load.stats import SPREAD_LIMIT, error_counts, percentile, spread
from servemesh.observe.cpu import pss_bytes, rss_bytes
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.apply import RouteManager
from servemesh.spec import MeshSpec, Ports, Replicas, load_spec
from servemesh.state.credentials import EdgeAuthMetadata
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

if TYPE_CHECKING:
    from servemesh.bench.model.run import ServerProcess

EDGE = "edge"
MODEL_ALONE = "model alone"
ECHO = "echo"
GATEWAY_DIRECT = "gateway direct"
WARMUP_S = 1.0
CALL_TIMEOUT_S = 5.0
# Idle CPU is read once the mesh sat this long after answering its first Predicts.
IDLE_SETTLE_S = 5.0
# The echo server's CPU, as a kind of its own (never summed into the mesh's).
ECHO_KIND = "echo"
# `--tls-cost`: the echo server again, serving mutual TLS with a certificate of the mesh's CA.
ECHO_TLS = "echo mTLS"
# The TLS sides of a Predict in Python processes: the gateway serves the edge's call and
# makes two (features, model), the feature and model servers serve one each. Envoy's sides
# (the edge listener, its call to the gateway, the zone Envoy's both ends) are BoringSSL in
# C++ and not counted here.
PYTHON_TLS_SIDES_PER_PREDICT = 5
# What the second fast-path issue asks, as ratios to what this design can reach measured in
# the same run, and bounds (docs/benchmarks.md, "Fast path, second pass").
TARGET_CPU_OVER_ECHO_C64 = 3.0
TARGET_RPS_OVER_ALONE_C64 = 0.8
TARGET_P50_OVER_ALONE_C1 = 2.5
TARGET_IDLE_CPU_MS_PER_S = 60.0
TARGET_P99_MS_C64 = 100.0
TARGET_MEMORY_MIB = 1.1 * 1024
TARGET_HEAVY_RPS_OVER_ALONE_C64 = 0.85


# The numeric OIP datatypes a model-alone row can be made of, in their wire layout.
WIRE_DTYPES = {
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
    "INT8": "|i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "UINT8": "|u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
}  # fmt: skip


@dataclass(frozen=True)
class Round:
    """One closed-loop measurement of one target at one concurrency."""

    target: str
    concurrency: int
    repeat: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    # CPU µs per successful answer, by process kind; "client" is the load generator's own.
    cpu_us: dict[str, float] = field(default_factory=dict)
    # failed calls by gRPC status
    error_codes: dict[str, int] = field(default_factory=dict)
    # h2load: streams it reset when its duration ended (not errors; at most one a stream)
    cancelled_at_stop: int = 0
    # h2load: what it saw fail itself (connections, HTTP statuses); the server side's count
    # (`errors`, `error_codes`) already holds every call that reached the server
    client_errors: dict[str, int] = field(default_factory=dict)


def model_alone_target(mesh: Mesh, model: str) -> tuple[Target, str, list[bytes]]:
    """ModelInfer for one row, straight to the first replica serving `model` (through no
    Envoy), with bodies built from the replica's own signature; (target, replica name, the
    bodies)."""
    # Every model server hosts every version of the spec's models.
    replica = next(i.name for i in mesh.spec.instances() if i.service == "model")
    dial = dial_service(mesh.spec, replica)
    with dial.channel() as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = stub.ModelMetadata(oip.ModelMetadataRequest(name=model), timeout=10)
    rng = np.random.default_rng(0)
    bodies = [_one_row(model, metadata, rng).SerializeToString() for _ in range(64)]
    return _raw_target(dial, f"/{OIP_SERVICE}/ModelInfer", bodies), replica, bodies


def _one_row(
    model: str, metadata: oip.ModelMetadataResponse, rng: np.random.Generator
) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=model)
    for tensor in metadata.inputs:
        shape = [1, *(max(1, d) for d in tensor.shape[1:])]
        values = rng.standard_normal(shape).astype(WIRE_DTYPES[tensor.datatype])
        request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=shape)
        request.raw_input_contents.append(values.tobytes())
    return request


def _raw_target(dial: Dial, method: str, bodies: Sequence[bytes]) -> Target:
    """A unary call with pre-serialised bodies whose answers are never parsed."""

    def build(channel: grpc.aio.Channel) -> Request:
        call = channel.unary_unary(method)

        async def send(index: int) -> Reply:
            await call(bodies[index % len(bodies)], timeout=CALL_TIMEOUT_S)
            return Reply()

        return send

    return Target(dial.address, build, dial.options, dial.credentials)


def cpu_per_answer(
    spent: Mapping[str, float], client_s: float, answered: float
) -> dict[str, float]:
    """CPU µs per answer by process kind from the seconds each spent, the load generator's
    own as "client"; empty when nothing was answered."""
    if not answered:
        return {}
    found = {kind: round(seconds / answered * 1e6, 1) for kind, seconds in sorted(spent.items())}
    found["client"] = round(client_s / answered * 1e6, 1)
    return found


def measure(
    mesh: Mesh,
    target: Target,
    name: str,
    concurrency: int,
    seconds: float,
    repeat: int,
    cpu_of: Callable[[], Mapping[str, float]] | None = None,
) -> Round:
    """`concurrency` callers back to back for WARMUP_S + `seconds`; the measured window's
    answers, and the CPU of every mesh process (or what `cpu_of` reads, by kind) and of the
    client per answer."""
    read = cpu_of or (lambda: cpu_by_kind(mesh))
    before, client_before, started = read(), time.process_time(), time.monotonic()
    run = asyncio.run(
        closed_loop(target, ClosedLoop(workers=concurrency, duration_s=WARMUP_S + seconds))
    )
    after, client_after = read(), time.process_time()
    elapsed = time.monotonic() - started
    measured = run.window(WARMUP_S, WARMUP_S + seconds)
    summary = summarize(measured, seconds)
    # The CPU covers the warm-up too: divide by the answers of the whole run's span.
    answered = summary.ok * elapsed / seconds
    spent = {kind: after[kind] - before.get(kind, after[kind]) for kind in after}
    cpu_us = cpu_per_answer(spent, client_after - client_before, answered)
    return Round(
        target=name,
        concurrency=concurrency,
        repeat=repeat,
        rps=round(summary.ok / seconds, 1),
        p50_ms=round(summary.p50_ms, 2),
        p99_ms=round(summary.p99_ms, 2),
        errors=summary.count - summary.ok,
        cpu_us=cpu_us,
        error_codes=error_counts(measured),
    )


@dataclass(frozen=True)
class Row:
    """One target at one concurrency over its rounds: medians with min-max and spread."""

    target: str
    concurrency: int
    repeats: int
    rps: list[float]
    rps_median: float
    rps_min: float
    rps_max: float
    rps_spread: float
    flagged_wide: bool
    p50_ms_median: float
    p99_ms_median: float
    p99_ms_max: float
    errors: int
    # CPU µs per answer by process kind (median of the rounds; "client" is the load's own).
    cpu_us_per_answer: dict[str, float]
    # Summed over the mesh's processes (the client left out), per round: median, min, max.
    cpu_us_mesh_median: float
    cpu_us_mesh_min: float
    cpu_us_mesh_max: float


def h2load_round(
    name: str, concurrency: int, repeat: int, measured: bench_h2load.Measured
) -> Round:
    """An h2load window as a round: CPU µs per OK answer by kind, the client's as "client"."""
    cpu_us = cpu_per_answer(measured.cpu_seconds, measured.client_cpu_seconds, measured.ok)
    return Round(
        target=name,
        concurrency=concurrency,
        repeat=repeat,
        rps=round(measured.ok / measured.seconds, 1) if measured.seconds else 0.0,
        p50_ms=round(percentile(measured.latencies_ms, 50), 2),
        p99_ms=round(percentile(measured.latencies_ms, 99), 2),
        errors=sum(measured.errors.values()),
        cpu_us=cpu_us,
        error_codes=dict(measured.errors),
        cancelled_at_stop=measured.cancelled_at_stop,
        client_errors=dict(measured.client_errors),
    )


def summarize_rows(rounds: Sequence[Round], wide: set[tuple[str, int]]) -> list[Row]:
    """One row per (target, concurrency), in concurrency order."""
    rows = []
    keys = sorted({(r.target, r.concurrency) for r in rounds}, key=lambda k: (k[1], k[0]))
    for target, concurrency in keys:
        mine = [r for r in rounds if r.target == target and r.concurrency == concurrency]
        rps = [r.rps for r in mine]
        kinds = sorted({k for r in mine for k in r.cpu_us})
        cpu = {k: round(statistics.median(r.cpu_us.get(k, 0.0) for r in mine), 1) for k in kinds}
        mesh_total = [mesh_cpu(r) for r in mine]
        rows.append(
            Row(
                target=target,
                concurrency=concurrency,
                repeats=len(mine),
                rps=rps,
                rps_median=round(statistics.median(rps), 1),
                rps_min=min(rps),
                rps_max=max(rps),
                rps_spread=round(spread(rps), 3),
                flagged_wide=(target, concurrency) in wide,
                p50_ms_median=round(statistics.median(r.p50_ms for r in mine), 2),
                p99_ms_median=round(statistics.median(r.p99_ms for r in mine), 2),
                p99_ms_max=max(r.p99_ms for r in mine),
                errors=sum(r.errors for r in mine),
                cpu_us_per_answer=cpu,
                cpu_us_mesh_median=round(statistics.median(mesh_total), 1),
                cpu_us_mesh_min=round(min(mesh_total), 1),
                cpu_us_mesh_max=round(max(mesh_total), 1),
            )
        )
    return rows


def paired_ratios(rounds: Sequence[Round], concurrency: int) -> list[float]:
    """Edge req/s over model-alone req/s, repeat by repeat (measured back to back)."""
    return per_repeat_ratios(rounds, concurrency, lambda r: r.rps, EDGE, MODEL_ALONE)


def mesh_cpu(r: Round) -> float:
    """CPU µs per answer summed over the mesh's processes (the client's own left out)."""
    return sum(v for k, v in r.cpu_us.items() if k != "client")


def per_repeat_ratios(
    rounds: Sequence[Round],
    concurrency: int,
    value: Callable[[Round], float],
    top: str,
    bottom: str,
) -> list[float]:
    """`value` of `top` over `value` of `bottom`, repeat by repeat (measured back to back)."""
    under = {
        r.repeat: value(r) for r in rounds if r.target == bottom and r.concurrency == concurrency
    }
    return [
        value(r) / under[r.repeat]
        for r in rounds
        if r.target == top and r.concurrency == concurrency and under.get(r.repeat)
    ]


def _summary(values: Sequence[float]) -> dict[str, object]:
    """Per-repeat ratios with their median and range, rounded for the report."""
    return {
        "per_repeat": [round(v, 3) for v in values],
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def idle_reading(mesh: Mesh, idle_s: float, settle_s: float = IDLE_SETTLE_S) -> dict[str, object]:
    """The mesh's CPU over `idle_s` with no traffic (ms/s) and its memory (RSS, and PSS:
    shared pages counted once; MiB), by process kind, with totals, read once the mesh sat
    idle `settle_s` (the first seconds after start-up still hold start-up's work). The
    process running the mesh (here the benchmark itself, `servemesh up` otherwise) is not
    counted."""
    time.sleep(settle_s)
    before, started = cpu_by_kind(mesh), time.monotonic()
    time.sleep(idle_s)
    after, elapsed = cpu_by_kind(mesh), time.monotonic() - started
    cpu = {k: round((after[k] - before.get(k, after[k])) / elapsed * 1e3, 1) for k in sorted(after)}
    memory = _mib_by_kind(mesh, rss_bytes)
    shared_out = _mib_by_kind(mesh, pss_bytes)
    return {
        "seconds": round(elapsed, 1),
        "cpu_ms_per_s": cpu,
        "cpu_ms_per_s_total": round(sum(cpu.values()), 1),
        "rss_mib": memory,
        "rss_mib_total": round(sum(memory.values()), 1),
        # What the processes use together: a page they share is counted once (Pss).
        "pss_mib": shared_out,
        "pss_mib_total": round(sum(shared_out.values()), 1),
    }


def _mib_by_kind(mesh: Mesh, read: Callable[[int], int | None]) -> dict[str, float]:
    """`read(pid)` bytes of every running process of `mesh`, summed by kind, in MiB."""
    found = sum_by_kind(mesh, lambda pid: None if (b := read(pid)) is None else b / 2**20)
    return {kind: round(mib, 1) for kind, mib in sorted(found.items())}


def target_checks(
    rows: Sequence[Row], ratios: Mapping[str, list[float]], idle: Mapping[str, object]
) -> list[dict[str, object]]:
    """The second fast-path issue's targets, each with the figure measured and whether it
    is met (ratios: the median of the per-repeat ratios)."""
    by = {(r.target, r.concurrency): r for r in rows}
    checks: list[dict[str, object]] = []

    def check(name: str, value: float, goal: float, at_least: bool) -> None:
        met = value >= goal if at_least else value <= goal
        checks.append({"target": name, "measured": value, "goal": goal, "met": met})

    def median(name: str) -> float | None:
        values = ratios.get(name)
        return round(statistics.median(values), 3) if values else None

    if (value := median("cpu_over_echo_c64")) is not None:
        check("mesh CPU per Predict / echo CPU per call, c=64 <=", value,
              TARGET_CPU_OVER_ECHO_C64, False)  # fmt: skip
    if (value := median("rps_over_alone_c64")) is not None:
        check("edge req/s / model alone req/s, c=64 >=", value, TARGET_RPS_OVER_ALONE_C64, True)
    if (value := median("p50_over_alone_c1")) is not None:
        check("edge p50 / model alone p50, c=1 <=", value, TARGET_P50_OVER_ALONE_C1, False)
    idle_cpu = idle.get("cpu_ms_per_s_total")
    if isinstance(idle_cpu, float):
        check("idle mesh CPU ms/s <=", idle_cpu, TARGET_IDLE_CPU_MS_PER_S, False)
    edge64 = by.get((EDGE, 64))
    if edge64:
        check("edge p99 ms, c=64 <=", edge64.p99_ms_median, TARGET_P99_MS_C64, False)
    memory = idle.get("rss_mib_total")
    if isinstance(memory, float):
        check("mesh memory (RSS) MiB <=", memory, round(TARGET_MEMORY_MIB), False)
    return checks


def heavy_target_checks(ratios: Mapping[str, list[float]]) -> list[dict[str, object]]:
    """Issue #26's heavy-model target: the mesh's req/s over its model server alone at c=64."""
    values = ratios.get("rps_over_alone_c64")
    if not values:
        return []
    value = round(statistics.median(values), 3)
    goal = TARGET_HEAVY_RPS_OVER_ALONE_C64
    return [
        {
            "target": "heavy: edge req/s / model alone req/s, c=64 >=",
            "measured": value,
            "goal": goal,
            "met": value >= goal,
        }
    ]


def weight_change_times(
    mesh: Mesh, count: int, auth: EdgeAuthMetadata
) -> list[tuple[float, float]]:
    """Flip the first model's split between two versions `count` times.

    Per flip: (ms from the file swap to Envoy's admin API confirming the new config,
    ms from the start of the apply to the first Predict answered by the new version).
    """
    model_name, model = next(iter(sorted(mesh.spec.models.items())))
    first, second = sorted(model.versions)[:2]
    manager = RouteManager(mesh.paths)
    times = []
    with dial_every_edge(mesh.spec).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.PredictRequest(model=model_name, entity_ids=["user-0"])
        for flip in range(count):
            target = second if flip % 2 == 0 else first
            started = time.perf_counter()
            result = manager.set_weights(model_name, {target: 100})
            while True:
                reply = stub.Predict(request, timeout=5, metadata=auth.metadata())
                if reply.model_version == target:
                    break
            times.append((result.confirm_ms, (time.perf_counter() - started) * 1000))
    return times


def heavy_spec(spec: MeshSpec) -> MeshSpec:
    """`spec` serving the heavy bench model alone (two versions, all traffic on v1, so the
    weight-change timing still has a split to flip), on the first model's feature view."""
    from servemesh.bench.model.models import BENCH_MODELS
    from servemesh.spec import ModelVersionSpec

    heavy = BENCH_MODELS["heavy"]
    template = spec.models[next(iter(sorted(spec.models)))]
    model = template.model_copy(
        update={
            "versions": {
                "v1": ModelVersionSpec(source=heavy.source(1)),
                "v2": ModelVersionSpec(source=heavy.source(2)),
            },
            "traffic": {"v1": 100, "v2": 0},
            "shadow": None,
            "tiers": None,
        }
    )
    return spec.model_copy(update={"models": {heavy.name: model}})


def bench_spec(spec: MeshSpec) -> MeshSpec:
    """`spec` on free ports without Prometheus, whose scrapes would take CPU from the mesh
    being measured, and with one caller allowed the edge's whole rate: the load generator
    is one caller, and its own bucket (1,000/s by default) would shed what the mesh could
    answer (RESOURCE_EXHAUSTED at 1,300/s and more, once its burst was spent). The buckets
    stay in place, so their cost per call is still measured."""
    limit = spec.traffic.rate_limit
    one_caller_all = limit.model_copy(
        update={
            "per_caller_requests_per_second": limit.requests_per_second,
            "per_caller_burst": limit.burst,
        }
    )
    return spec.model_copy(
        update={
            "ports": Ports.free(),
            "metrics": spec.metrics.model_copy(update={"prometheus": "off"}),
            "traffic": spec.traffic.model_copy(update={"rate_limit": one_caller_all}),
        }
    )


def one_zone_spec(spec: MeshSpec, model_servers: int = 1) -> MeshSpec:
    """`bench_spec` on the spec's first zone alone: one gateway and one feature service,
    `model_servers` model servers (what one pool's load or one replica of each kind is
    measured on)."""
    zone = spec.zones[0]
    one = Replicas(per_zone={zone: 1})
    return bench_spec(spec).model_copy(
        update={
            "zones": [zone],
            "gateway": one,
            "feature": one,
            "model_servers": Replicas(per_zone={zone: model_servers}),
        }
    )


def bench_predict(
    spec: MeshSpec,
    concurrencies: Sequence[int] = (1, 64),
    seconds: float = 6.0,
    repeats: int = 3,
    *,
    direct: bool = False,
    weight_changes: int = 10,
    idle_s: float = 20.0,
    model: str = "demo",
    tls_cost: bool = False,
    client: str = "python",
    connections: int = 1,
    progress: Callable[[Round], None] = lambda _: None,
) -> dict[str, object]:
    """Start a mesh and the echo server, time the mesh's start, read its idle CPU and
    memory, then measure every target at every concurrency `repeats` times, interleaved;
    the report as a JSON-able dict. `tls_cost`: also the echo server serving mutual TLS, and
    what TLS adds to one call (client and server) beside the plaintext echo. `client`:
    python (servemesh.load's asyncio client, one channel) or h2load (`bench_h2load`: the
    model-alone row is then the standalone model server, plaintext), whose streams share
    `connections` connections in every row."""
    from servemesh.bench.model.run import BenchConfig, ServerProcess
    from servemesh.bench.model.run import Target as ServerTarget

    spec = bench_spec(heavy_spec(spec) if model == "heavy" else spec)
    if client == "h2load":
        check_h2load_fits(spec, model, direct=direct, tls_cost=tls_cost)
        check_connections(
            concurrencies, connections, spec.traffic.connections.edge_max_concurrent_streams
        )
        spec = without_tiers(spec)
    elif client != "python":
        raise UsageError(f"--client: {client!r} is not one of python, h2load")
    elif connections != 1:
        raise UsageError("--connections: the Python client sends over one channel; use h2load")
    model_name = next(iter(sorted(spec.models)))
    # Every process is stopped on the way out, whatever fails (the last started, first).
    with tempfile.TemporaryDirectory() as state, contextlib.ExitStack() as running:
        workdir = Path(state)
        echo = ServerProcess(
            ServerTarget(name="echo", kind=ECHO_KIND), BenchConfig(server_cpu=None), workdir
        )
        running.callback(echo.stop)
        mesh = Mesh.from_spec(spec, workdir / "mesh")
        running.callback(mesh.stop)
        started = time.perf_counter()
        mesh.start()
        startup_s = time.perf_counter() - started
        echo.wait_ready()
        wait_answering(mesh)
        idle = idle_reading(mesh, idle_s)
        standalone: ServerProcess | None = None
        if client == "h2load":
            # h2load cannot present the replicas' client certificate: the model alone is
            # the standalone model server, started once the mesh's start-up time and
            # idle figures are read (its torch would share pages with the mesh's).
            standalone = ServerProcess(
                ServerTarget(
                    name="model-alone",
                    kind="model",
                    batching=spec.models[model_name].batching.model_dump(mode="json"),
                ),
                BenchConfig(server_cpu=None, model=model),
                workdir,
            )
            running.callback(standalone.stop)
            standalone.wait_ready()
        entities = max(1, spec.demo.entities)
        alone, replica, bodies = model_alone_target(mesh, model_name)
        if standalone is not None:
            replica = f"standalone model server ({standalone.address}, plaintext)"
        echo_target = _raw_target(Dial(echo.address, None), f"/{OIP_SERVICE}/ModelInfer", bodies)
        echo_tls: ServerProcess | None = None
        if tls_cost:
            echo_tls = _tls_echo(mesh, workdir)
            running.callback(echo_tls.stop)
        auth = EdgeAuthMetadata(mesh.spec, BENCH_CALLER)
        targets = {
            EDGE: predict_target(
                dial_every_edge(mesh.spec),
                model=model_name,
                entities=entities,
                timeout_s=CALL_TIMEOUT_S,
                metadata=auth.metadata,
            ),
            MODEL_ALONE: alone,
            ECHO: echo_target,
        }
        if echo_tls is not None:
            targets[ECHO_TLS] = _raw_target(
                dial_address(mesh.spec, echo_tls.address, BENCH_ECHO_IDENTITY),
                f"/{OIP_SERVICE}/ModelInfer",
                bodies,
            )
        if direct:
            gateway = next(i.name for i in mesh.spec.instances() if i.service == "gateway")
            targets[GATEWAY_DIRECT] = predict_target(
                dial_service(mesh.spec, gateway),
                model=model_name,
                entities=entities,
                timeout_s=CALL_TIMEOUT_S,
            )
        rounds: list[Round] = []

        servers = {ECHO: echo, ECHO_TLS: echo_tls}
        measure_with_h2load = (
            h2load_rounds(
                mesh, model_name, bodies[0], seconds, workdir, echo, standalone, connections, auth
            )
            if standalone is not None
            else None
        )

        def run_round(name: str, c: int, repeat: int) -> Round:
            if measure_with_h2load is not None:
                found = measure_with_h2load(name, c, repeat)
            else:
                server = servers.get(name)
                cpu_of = (lambda: {ECHO_KIND: server.cpu_seconds()}) if server else None
                found = measure(mesh, targets[name], name, c, seconds, repeat, cpu_of)
            progress(found)
            rounds.append(found)
            return found

        wide: set[tuple[str, int]] = set()
        for c in concurrencies:
            for repeat in range(repeats):
                # The order turns each repeat: a drift in the machine's speed favours none.
                names = list(targets)
                shift = repeat % len(names)
                for name in names[shift:] + names[:shift]:
                    run_round(name, c, repeat)
            for name in targets:
                rps = [r.rps for r in rounds if r.target == name and r.concurrency == c]
                if spread(rps) > SPREAD_LIMIT:
                    run_round(name, c, repeats)
                    rps = [r.rps for r in rounds if r.target == name and r.concurrency == c]
                    if spread(rps) > SPREAD_LIMIT:
                        wide.add((name, c))
        changes = weight_change_times(mesh, weight_changes, auth) if weight_changes else []
    rows = summarize_rows(rounds, wide)
    ratios = {c: paired_ratios(rounds, c) for c in concurrencies}
    same_run = {
        "cpu_over_echo_c64": per_repeat_ratios(rounds, 64, mesh_cpu, EDGE, ECHO),
        "rps_over_alone_c64": per_repeat_ratios(rounds, 64, lambda r: r.rps, EDGE, MODEL_ALONE),
        "p50_over_alone_c1": per_repeat_ratios(rounds, 1, lambda r: r.p50_ms, EDGE, MODEL_ALONE),
    }
    report: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "client": client,
        "connections": connections,
        "model": model_name,
        "model_alone_replica": replica,
        "seconds": seconds,
        "repeats": repeats,
        "sample_ratio": spec.tracing.sample_ratio if spec.tracing.enabled else 0.0,
        "prediction_log": spec.prediction_log.enabled,
        "startup_s": round(startup_s, 2),
        "idle": idle,
        "rows": [asdict(r) for r in rows],
        "ratios": {name: _summary(values) for name, values in same_run.items() if values},
        "edge_over_model_alone": {str(c): _summary(r) for c, r in ratios.items() if r},
        "targets": (
            heavy_target_checks(same_run)
            if model == "heavy"
            else target_checks(rows, same_run, idle)
        ),
        "rounds": [asdict(r) for r in rounds],
    }
    if tls_cost:
        report["tls_cost"] = tls_cost_report(rounds, concurrencies)
    if changes:
        report["weight_changes"] = {
            "count": len(changes),
            "confirm_ms_median": round(statistics.median(c[0] for c in changes), 1),
            "confirm_ms_max": round(max(c[0] for c in changes), 1),
            "effective_ms_median": round(statistics.median(c[1] for c in changes), 1),
            "effective_ms_max": round(max(c[1] for c in changes), 1),
        }
    return report


def check_h2load_fits(spec: MeshSpec, model: str, *, direct: bool, tls_cost: bool) -> None:
    """Refuse (UsageError) what h2load cannot measure: rows that need a client certificate,
    and a model the standalone server cannot host (it serves the bench's own models)."""
    from servemesh.bench.model.h2load import h2load_path
    from servemesh.bench.model.models import BENCH_MODELS

    h2load_path()  # the install line, before anything starts
    if direct or tls_cost:
        raise UsageError(
            "--client h2load: --direct and --tls-cost need a client certificate, which "
            "h2load cannot present; run them with --client python"
        )
    if spec.traffic.edge_auth.active_mode == "basic":
        raise UsageError(
            "--client h2load: traffic.edge_auth is basic, and h2load takes its headers on "
            "its command line, where other users of this host can read them; the mesh's "
            "basic key would be one of them. Run with --client python, or jwt edge auth "
            "(each round then sends a token signed for that round alone)"
        )
    name, first = next(iter(sorted(spec.models.items())))
    bench_model = BENCH_MODELS[model]
    served = max(first.traffic, key=lambda v: first.traffic[v])
    source = first.versions[served].source
    if name != bench_model.name or source != bench_model.source(1):
        raise UsageError(
            f"--client h2load: the model alone is the standalone server of {bench_model.name!r} "
            f"({bench_model.source(1)}), and the spec's first model is {name!r} "
            f"({served}: {source}); measure that spec with --client python"
        )


def check_connections(
    concurrencies: Sequence[int], connections: int, max_streams: int | None = None
) -> None:
    """Every concurrency must share evenly over the connections (h2load's -c and -m), and
    no connection may carry more streams than the edge lets one connection hold
    (`max_streams`): h2load would send fewer than the round says."""
    if connections < 1:
        raise UsageError(f"--connections {connections}: at least one")
    uneven = [c for c in concurrencies if c < connections or c % connections]
    if uneven:
        raise UsageError(
            f"--connections {connections}: each --concurrency must be a multiple of it "
            f"(not {', '.join(map(str, uneven))})"
        )
    crowded = [c for c in concurrencies if max_streams and c // connections > max_streams]
    if crowded:
        raise UsageError(
            f"--connections {connections}: --concurrency {max(crowded)} would put "
            f"{max(crowded) // connections} streams on one connection, and the edge holds "
            f"{max_streams} (traffic.connections.edge_max_concurrent_streams); use more "
            "connections"
        )


# What a round's token outlives the round by (h2load's start and the marker call after).
ROUND_TOKEN_MARGIN_S = 30.0


def round_credentials(auth: EdgeAuthMetadata, round_s: float) -> list[tuple[str, str]]:
    """The headers h2load sends at the edge for one round of `round_s` seconds: a token
    signed for this round alone (jwt), nothing (off). Basic credentials never go on a
    command line (check_h2load_fits refuses that mode)."""
    if auth.mode == "jwt":
        token = auth.sign(min(auth.token_ttl_s(), round_s + ROUND_TOKEN_MARGIN_S))
        return [(AUTHORIZATION_HEADER, f"Bearer {token}")]
    if auth.mode == "basic":
        raise UsageError("--client h2load: basic edge credentials never go on a command line")
    return []


def without_tiers(spec: MeshSpec) -> MeshSpec:
    """`spec` with every model's tiers off: h2load asks for one entity every call, which a
    cache tier would answer from memory."""
    models = {n: m.model_copy(update={"tiers": None}) for n, m in spec.models.items()}
    return spec.model_copy(update={"models": models})


def h2load_rounds(
    mesh: Mesh,
    model_name: str,
    model_body: bytes,
    seconds: float,
    workdir: Path,
    echo: ServerProcess,
    standalone: ServerProcess,
    connections: int,
    auth: EdgeAuthMetadata,
) -> Callable[[str, int, int], Round]:
    """A round maker for h2load: the edge (TLS unless the spec turns it off; one entity),
    the standalone model server and the echo server (ModelInfer for one row). With jwt
    edge auth each edge round sends a token signed for that round alone (h2load takes
    headers on its command line, where other users of the host can read them)."""
    from servemesh.bench.model.run import probe

    entity = "user-0"
    edge_file = bench_h2load.frame_file(
        workdir, "predict", bench_h2load.predict_body(model_name, entity)
    )
    model_file = bench_h2load.frame_file(workdir, "model-infer", model_body)
    for server in (standalone, echo):
        probe(server.address, model_body)
    # h2load drives the first edge alone (one address); its marker goes there too.
    edge_dial = dial_edge(mesh.spec)
    admin = AdminClient.of_mesh(mesh.state_dir)

    def make(name: str, c: int, repeat: int) -> Round:
        if name == EDGE:
            measured = bench_h2load.measure_edge(
                mesh.spec.edge_address,
                edge_file,
                c,
                seconds,
                WARMUP_S,
                CALL_TIMEOUT_S,
                tls=mesh.spec.tls.edge,
                access_log=mesh.logs_dir / "envoy-edge-access.log",
                read_cpu=lambda: cpu_by_kind(mesh),
                marker=lambda: bench_h2load.send_marker(
                    edge_dial, model_name, entity, auth.metadata()
                ),
                flush=lambda: admin.post("/reopen_logs"),
                connections=connections,
                headers=round_credentials(auth, WARMUP_S + seconds + CALL_TIMEOUT_S),
            )
        else:
            server, kind = (standalone, "model") if name == MODEL_ALONE else (echo, ECHO_KIND)
            measured = bench_h2load.measure_server(
                server, kind, model_file, c, seconds, WARMUP_S, CALL_TIMEOUT_S, connections
            )
        return h2load_round(name, c, repeat, measured)

    return make


def _tls_echo(mesh: Mesh, workdir: Path) -> ServerProcess:
    """The echo server serving mutual TLS with a certificate of `mesh`'s CA, ready."""
    from servemesh.bench.model.run import BenchConfig, ServerProcess
    from servemesh.bench.model.run import Target as ServerTarget

    enrolled(mesh.spec, BENCH_ECHO_IDENTITY)  # issued here, before the server reads it
    server = ServerProcess(
        ServerTarget(
            name="echo-tls", kind=ECHO_KIND, tls=(str(mesh.spec.state_dir), mesh.spec.name)
        ),
        BenchConfig(server_cpu=None),
        workdir,
    )
    server.wait_ready()
    return server


def call_cpu(r: Round) -> float:
    """CPU µs per answer of the server and the client together."""
    return sum(r.cpu_us.values())


def tls_cost_report(rounds: Sequence[Round], concurrencies: Sequence[int]) -> dict[str, object]:
    """What mutual TLS adds to one call, by concurrency, repeat by repeat (the TLS echo and
    the plaintext echo measured back to back): CPU µs per call (client and server), that
    over the plaintext call's, and the Python sides of a Predict priced at half of it."""
    found: dict[str, object] = {}
    for c in concurrencies:
        plain = {r.repeat: r for r in rounds if r.target == ECHO and r.concurrency == c}
        pairs = [
            (r, plain[r.repeat])
            for r in rounds
            if r.target == ECHO_TLS and r.concurrency == c and r.repeat in plain
        ]
        if not pairs:
            continue
        added = [call_cpu(t) - call_cpu(p) for t, p in pairs]
        found[str(c)] = {
            "us_per_call_added": _summary(added),
            "cpu_ratio": _summary([call_cpu(t) / call_cpu(p) for t, p in pairs]),
            "rps_ratio": _summary([t.rps / p.rps for t, p in pairs]),
            "us_per_predict_python_sides": round(
                statistics.median(added) / 2 * PYTHON_TLS_SIDES_PER_PREDICT, 1
            ),
        }
    return found


def round_line(found: Round) -> str:
    return (
        f"  {found.target} c={found.concurrency} #{found.repeat}: {found.rps:.0f} req/s, "
        f"p99 {found.p99_ms:.1f} ms, mesh CPU "
        f"{mesh_cpu(found):.0f} µs/answer"
        + "".join(f", {code} {n}" for code, n in sorted(found.error_codes.items()))
        + (f", {found.cancelled_at_stop} reset at stop" if found.cancelled_at_stop else "")
    )


def rate_cells(row: Mapping[str, Any]) -> tuple[str, ...]:
    """A row's first cells: target, concurrency, median req/s, min-max."""
    return (
        row["target"],
        str(row["concurrency"]),
        f"{row['rps_median']:.0f}",
        f"{row['rps_min']:.0f}-{row['rps_max']:.0f}",
    )


def as_report(report: Mapping[str, object]) -> BenchReport:
    """The run for people: the rows, the CPU by process kind, the same-run ratios, the idle
    mesh and the targets."""
    heading = []
    if report.get("client") == "h2load":
        heading.append(
            f"client: h2load (one pre-built request, the streams over {report['connections']} "
            "connection(s); the edge's outcomes from its access log); "
            f"model alone: {report['model_alone_replica']}"
        )
    heading.append(
        f"mesh start-up: {report['startup_s']} s; tracing ratio {report['sample_ratio']}, "
        f"prediction log {'on' if report['prediction_log'] else 'off'}; "
        f"{report['repeats']} repeats of {report['seconds']} s"
    )
    shown = BenchReport("servemesh bench predict", report, title="\n".join(heading), width=120)
    rows = report["rows"]
    assert isinstance(rows, list)
    table = shown.table(
        "Predict through the edge vs the model server alone (medians, min-max)",
        ("target", "conc.", "req/s", "min-max", "spread", "p50 ms", "p99 ms", "errors"),
        left={"target"},
    )
    for r in rows:
        table.add_row(
            *rate_cells(r),
            f"{r['rps_spread']:.0%}" + (" WIDE" if r["flagged_wide"] else ""),
            f"{r['p50_ms_median']:.2f}",
            f"{r['p99_ms_median']:.2f}",
            str(r["errors"]),
        )
    kinds = sorted({k for r in rows for k in r["cpu_us_per_answer"] if k != "client"})
    cpu = shown.table(
        "CPU µs per answer by process kind (median of the rounds)",
        ("target", "conc.", *kinds, "mesh (min-max)", "client"),
        left={"target"},
    )
    for r in rows:
        by_kind = r["cpu_us_per_answer"]
        cpu.add_row(
            r["target"],
            str(r["concurrency"]),
            *(f"{by_kind.get(k, 0.0):.0f}" for k in kinds),
            f"{r['cpu_us_mesh_median']:.0f} ({r['cpu_us_mesh_min']:.0f}-"
            f"{r['cpu_us_mesh_max']:.0f})",
            f"{by_kind.get('client', 0.0):.0f}",
        )
    ratios = report["edge_over_model_alone"]
    assert isinstance(ratios, dict)
    for c, r in ratios.items():
        shown.ratio(f"edge / model alone at c={c}", r["median"], r["per_repeat"])
    idle = report.get("idle")
    if isinstance(idle, dict):
        by_kind = ", ".join(f"{k} {v:.1f}" for k, v in idle["cpu_ms_per_s"].items())
        shown.note(
            f"idle mesh ({idle['seconds']} s, no traffic): {idle['cpu_ms_per_s_total']:.1f} "
            f"ms/s of CPU ({by_kind}); memory {idle['rss_mib_total']:.0f} MiB RSS ("
            + ", ".join(f"{k} {v:.0f}" for k, v in idle["rss_mib"].items())
            + ")"
        )
        if idle.get("pss_mib"):
            shown.note(
                f"  the same memory with shared pages counted once (PSS): "
                f"{idle['pss_mib_total']:.0f} MiB ("
                + ", ".join(f"{k} {v:.0f}" for k, v in idle["pss_mib"].items())
                + ")"
            )
    same_run = report.get("ratios")
    if isinstance(same_run, dict):
        for name, r in same_run.items():
            shown.ratio(name, r["median"], r["per_repeat"])
    tls = report.get("tls_cost")
    if isinstance(tls, dict):
        for c, t in tls.items():
            added = t["us_per_call_added"]
            shown.note(
                f"mutual TLS at c={c}: +{added['median']:.0f} µs CPU per call, client and "
                f"server ({added['min']:.0f}-{added['max']:.0f}), {t['cpu_ratio']['median']:.2f}x "
                f"the plaintext call's; req/s {t['rps_ratio']['median']:.2f}x; a Predict's "
                f"{PYTHON_TLS_SIDES_PER_PREDICT} Python TLS sides about "
                f"{t['us_per_predict_python_sides']:.0f} µs"
            )
    checks = report["targets"]
    assert isinstance(checks, list)
    for check in checks:
        mark = "met" if check["met"] else "MISSED"
        shown.note(f"  {check['target']} {check['goal']}: {check['measured']} {mark}")
    changes = report.get("weight_changes")
    if isinstance(changes, dict):
        shown.note(
            f"weight changes ({changes['count']}, idle mesh): swap to confirmed by Envoy "
            f"median {changes['confirm_ms_median']} ms (max {changes['confirm_ms_max']}); "
            f"apply start to first answer from the new version median "
            f"{changes['effective_ms_median']} ms (max {changes['effective_ms_max']})"
        )
    return shown


def main(
    spec: str | None,
    concurrency: list[int],
    seconds: float,
    *,
    repeats: int = 3,
    quiet: bool = False,
    direct: bool = False,
    idle_seconds: float = 20.0,
    model: str = "demo",
    tls_cost: bool = False,
    client: str = "python",
    connections: int = 1,
) -> BenchReport:
    return as_report(
        bench_predict(
            load_spec(spec),
            concurrency,
            seconds,
            repeats,
            direct=direct,
            idle_s=idle_seconds,
            model=model,
            tls_cost=tls_cost,
            client=client,
            connections=connections,
            progress=progress(quiet, round_line),
        )
    )
