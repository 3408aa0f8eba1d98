"""`servemesh bench pool`: many models in one on-demand pool under a memory budget.

A registry process and one model server process of an on-demand pool (`pools.<p>.load:
on_demand`, a `memory_budget` that holds `--fit` of the models), on free ports and a state
dir of their own; `--models` demo MLPs (one seed each, ~1.19 MB of weights) are pushed,
then closed-loop callers spread ModelInfer calls over every model, uniformly and by a
Zipf law (a few hot models, a long tail). Each round starts cold (every version unloaded
through the control credential, as `servemesh models unload` does). A call is cold when
its answer says it waited for a load (`wire.LOAD_WAIT_PARAMETER`).

Reported per mix, as the median of the rounds and their spread (min-max): calls, errors
(each one counted: a bench with an error fails), req/s, hit ratio (calls that found their
version loaded), cold-call latency p50/p99 (the caller's whole call: load, warm-up, check,
answer), warm-call p50 and the evictions the server counted.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from pydantic import ByteSize

from servemesh.bench.report import BenchReport, to_stderr
from servemesh.contract.control_credential import control_metadata_for, ensure_control_token
from servemesh.contract.demo import demo_artifact
from servemesh.contract.percentiles import percentile
from servemesh.contract.wire import LOAD_VERSION_PARAMETER, LOAD_WAIT_PARAMETER
from servemesh.identity import Dial, dial_registry, dial_service
from servemesh.procs import GrpcHealth, Supervisor
from servemesh.registry.client import push_version
from servemesh.spec import (
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    PoolSpec,
    Ports,
    Replicas,
    ResolvedSpec,
    dump_spec,
    resolve,
)
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2

POOL = "many"
REPLICA = f"model-{POOL}-zone-a-0"
FEATURES = 64
# Weights of one demo MLP, as the server measures them (`on_demand.weight_bytes`): the
# budget is sized from it so that exactly `fit` versions fit.
DEMO_WEIGHT_BYTES = 1_185_796
MIXES = ("uniform", "zipf")
ZIPF_S = 1.1  # the law's exponent: the top quarter of 20 models takes ~60% of the calls
CALL_TIMEOUT_S = 10.0


@dataclass
class Round:
    mix: str
    seconds: float
    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    cold_ms: list[float] = field(default_factory=list)
    warm_ms: list[float] = field(default_factory=list)
    evictions: int = 0

    def row(self) -> dict[str, Any]:
        answered = len(self.cold_ms) + len(self.warm_ms)
        return {
            "mix": self.mix,
            "calls": self.calls,
            "errors": sum(self.errors.values()),
            "error_codes": dict(self.errors),
            "rps": self.calls / self.seconds,
            "hit_ratio": len(self.warm_ms) / answered if answered else 0.0,
            "cold_calls": len(self.cold_ms),
            "cold_p50_ms": percentile(self.cold_ms, 50) if self.cold_ms else None,
            "cold_p99_ms": percentile(self.cold_ms, 99) if self.cold_ms else None,
            "warm_p50_ms": percentile(self.warm_ms, 50) if self.warm_ms else None,
            "evictions": self.evictions,
        }


def model_names(count: int) -> list[str]:
    return [f"m{i:02d}" for i in range(count)]


def weights(mix: str, count: int) -> np.ndarray:
    """Each model's share of the calls: equal, or Zipf's 1/rank^s."""
    shares: np.ndarray
    if mix == "uniform":
        shares = np.ones(count)
    else:
        shares = 1.0 / np.arange(1, count + 1) ** ZIPF_S
    return shares / shares.sum()


def bench_spec(state_dir: Path, count: int, fit: int) -> ResolvedSpec:
    # Room for `fit` versions and part of one more: the measure is exact, the margin keeps
    # `fit` from being off by one should torch pad a storage.
    budget = DEMO_WEIGHT_BYTES * fit + DEMO_WEIGHT_BYTES // 2
    return resolve(
        MeshSpec(
            zones=["zone-a"],
            ports=Ports.free(),
            state_dir=str(state_dir),
            model_servers=Replicas(per_zone={"zone-a": 1}),
            gateway=Replicas(per_zone={"zone-a": 1}),
            feature=Replicas(per_zone={"zone-a": 1}),
            models={
                name: ModelSpec(
                    pool=POOL,
                    versions={"v1": ModelVersionSpec(source="registry")},
                    traffic={"v1": 100},
                )
                for name in model_names(count)
            },
            pools={POOL: PoolSpec(memory_budget=ByteSize(budget))},
        )
    )


def _start(supervisor: Supervisor, module: str, instance: str, spec_file: Path, dial: Dial) -> None:
    argv = [sys.executable, "-m", module, "--spec", str(spec_file), "--instance", instance]
    supervisor.start(instance, argv, ready=GrpcHealth(dial), timeout_s=120)


def _request(model: str, body: bytes) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=model, model_version="v1")
    request.inputs.add(name="features", datatype="FP32", shape=[1, FEATURES])
    request.raw_input_contents.append(body)
    return request


def _evictions(metrics_address: str) -> int:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(r"^servemesh_model_evictions_total (\S+)$", text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


async def _unload_all(
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, spec: ResolvedSpec
) -> None:
    """Every version out: each round starts cold, as after `servemesh models unload`."""
    credential = control_metadata_for(spec.state_dir)
    index = await stub.RepositoryIndex(oip.RepositoryIndexRequest(ready=True), timeout=10)
    for entry in index.models:
        await stub.RepositoryModelUnload(
            oip.RepositoryModelUnloadRequest(
                model_name=entry.name,
                parameters={
                    LOAD_VERSION_PARAMETER: oip.ModelRepositoryParameter(string_param=entry.version)
                },
            ),
            timeout=30,
            metadata=credential,
        )


async def run_round(
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub,
    spec: ResolvedSpec,
    mix: str,
    *,
    count: int,
    concurrency: int,
    seconds: float,
    seed: int,
) -> Round:
    await _unload_all(stub, spec)
    metrics = spec.metrics_address_of(REPLICA)
    evicted_before = await asyncio.to_thread(_evictions, metrics)
    names = model_names(count)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(names), size=1_000_000, p=weights(mix, count))
    body = rng.normal(size=(1, FEATURES)).astype(np.float32).tobytes()
    requests = [_request(name, body) for name in names]
    result = Round(mix, seconds)
    next_pick = 0
    stop = time.monotonic() + seconds

    async def caller() -> None:
        nonlocal next_pick
        while time.monotonic() < stop:
            index = int(picks[next_pick % len(picks)])
            next_pick += 1
            started = time.perf_counter()
            try:
                answer = await stub.ModelInfer(requests[index], timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                result.errors[code] = result.errors.get(code, 0) + 1
                result.calls += 1
                continue
            took = (time.perf_counter() - started) * 1000
            result.calls += 1
            if LOAD_WAIT_PARAMETER in answer.parameters:
                result.cold_ms.append(took)
            else:
                result.warm_ms.append(took)

    began = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    # The last calls may end after `stop`: rates are over the time they took.
    result.seconds = time.monotonic() - began
    result.evictions = await asyncio.to_thread(_evictions, metrics) - evicted_before
    return result


def _spread(rows: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    values = [row[key] for row in rows if row[key] is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(rounds: list[Round]) -> list[dict[str, Any]]:
    """Per mix: every round's row, and the median and min-max of each number."""
    out = []
    for mix in dict.fromkeys(r.mix for r in rounds):
        rows = [r.row() for r in rounds if r.mix == mix]
        summary: dict[str, Any] = {"mix": mix, "rounds": rows}
        for key in (
            "calls",
            "errors",
            "rps",
            "hit_ratio",
            "cold_p50_ms",
            "cold_p99_ms",
            "warm_p50_ms",
            "evictions",
        ):
            summary[key] = _spread(rows, key)
        summary["errors_total"] = sum(row["errors"] for row in rows)
        out.append(summary)
    return out


async def bench_pool(
    folder: Path,
    *,
    count: int,
    fit: int,
    concurrency: int,
    seconds: float,
    repeats: int,
    say: Any,
) -> dict[str, Any]:
    state = folder / "state"
    spec = bench_spec(state, count, fit)
    spec_file = folder / "mesh.yaml"
    spec_file.write_text(dump_spec(spec))
    ensure_control_token(spec.state_dir)
    with Supervisor(folder / "logs") as supervisor:
        say("starting a registry and the pool's model server")
        await asyncio.to_thread(
            _start, supervisor, "servemesh.registry", "registry-0", spec_file, dial_registry(spec)
        )
        async with dial_registry(spec).aio_channel() as channel:
            for seed, name in enumerate(model_names(count), start=1):
                await push_version(
                    channel,
                    model=name,
                    version="v1",
                    data=demo_artifact(seed).data,
                    inputs=[
                        registry_pb2.TensorSpec(name="features", datatype="FP32", shape=[-1, 64])
                    ],
                    outputs=[registry_pb2.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])],
                    credential=control_metadata_for(spec.state_dir),
                )
        await asyncio.to_thread(
            _start,
            supervisor,
            "servemesh.services.model",
            REPLICA,
            spec_file,
            dial_service(spec, REPLICA),
        )
        rounds: list[Round] = []
        async with dial_service(spec, REPLICA).aio_channel() as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for repeat in range(repeats):
                for mix in MIXES:
                    found = await run_round(
                        stub,
                        spec,
                        mix,
                        count=count,
                        concurrency=concurrency,
                        seconds=seconds,
                        seed=repeat,
                    )
                    row = found.row()
                    say(
                        f"round {repeat + 1}/{repeats} {mix}: {row['calls']} calls, "
                        f"{row['errors']} errors, {row['rps']:.0f} req/s, hit ratio "
                        f"{row['hit_ratio']:.2f}"
                    )
                    rounds.append(found)
    budget = spec.pools[POOL].memory_budget
    return {
        "config": {
            "models": count,
            "fit": fit,
            "budget_bytes": budget,
            "concurrency": concurrency,
            "seconds": seconds,
            "repeats": repeats,
            "zipf_s": ZIPF_S,
        },
        "mixes": aggregate(rounds),
    }


def _cell(spread: dict[str, float | None], fmt: str) -> str:
    if spread["median"] is None:
        return "-"
    return f"{spread['median']:{fmt}} ({spread['min']:{fmt}}-{spread['max']:{fmt}})"


def as_report(report: dict[str, Any]) -> BenchReport:
    """The run for people: a line per mix, median (min-max); exit status 1 with any
    failed call."""
    config = report["config"]
    errors = sum(mix["errors_total"] for mix in report["mixes"])
    shown = BenchReport(
        "servemesh bench pool",
        report,
        title=f"{config['models']} models in one on-demand pool, budget {config['budget_bytes']} "
        f"bytes (room for {config['fit']}), {config['concurrency']} callers, "
        f"{config['seconds']:.0f} s x {config['repeats']} rounds per mix; median (min-max)",
        status=0 if errors == 0 else 1,
    )
    header = ("mix", "calls", "errors", "req/s", "hit ratio", "cold p50 ms", "cold p99 ms")
    lines = [" | ".join(header) + " | warm p50 ms | evictions"]
    for mix in report["mixes"]:
        lines.append(
            " | ".join(
                (
                    mix["mix"],
                    _cell(mix["calls"], ".0f"),
                    str(mix["errors_total"]),
                    _cell(mix["rps"], ".0f"),
                    _cell(mix["hit_ratio"], ".2f"),
                    _cell(mix["cold_p50_ms"], ".1f"),
                    _cell(mix["cold_p99_ms"], ".1f"),
                    _cell(mix["warm_p50_ms"], ".2f"),
                    _cell(mix["evictions"], ".0f"),
                )
            )
        )
    shown.note("\n".join(lines))
    return shown


def main(
    *,
    models: int = 20,
    fit: int = 5,
    concurrency: int = 8,
    seconds: float = 8.0,
    repeats: int = 3,
) -> BenchReport:
    if not 1 <= fit < models:
        raise SystemExit(f"--fit must be between 1 and --models - 1, got {fit}")
    with tempfile.TemporaryDirectory(prefix="servemesh-bench-pool-") as folder:
        report = asyncio.run(
            bench_pool(
                Path(folder),
                count=models,
                fit=fit,
                concurrency=concurrency,
                seconds=seconds,
                repeats=repeats,
                say=to_stderr,
            )
        )
    return as_report(report)
