"""The processes `servemesh bench model` measures, each pinned to the server core.

    python -m servemesh.bench.model.targets model --batching '{"dispatch": "fixed_window"}'
    python -m servemesh.bench.model.targets model --model heavy
    python -m servemesh.bench.model.targets model --model heavy --variant int8
    python -m servemesh.bench.model.targets echo
    python -m servemesh.bench.model.targets echo --tls-state-dir STATE --tls-mesh NAME
    python -m servemesh.bench.model.targets ceiling --seconds 2

`model` is the real model server (`services.model.app.build_server`, metrics endpoint
included) hosting a bench model (`models.py`: the demo fraud MLP by default, `--model heavy`
the compute-bound one), loaded from its artifact instead of a registry. `echo`
is the same server stack (ServiceServer, OIP servicer, same request and answer sizes) with
no validation, batching or model: the protocol ceiling; plaintext, or mutual TLS with a
certificate of a mesh's CA (`--tls-state-dir`, issued beforehand), to read what TLS costs
one call. Both write their ports as JSON to
--port-file once serving, and drain on SIGTERM. `ceiling` prints, as JSON, what the model
does in-process with no gRPC: forward passes at batch 1 and at the maximum batch size, and
the batcher driven by coroutines.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Literal

import grpc
import numpy as np

from servemesh.bench.model.models import BENCH_MODELS, VARIANTS, BenchModel
from servemesh.contract.demo import N_FEATURES, Artifact
from servemesh.contract.wire import REPLICA_PARAMETER, ZONE_PARAMETER
from servemesh.identity.credentials import server_credentials
from servemesh.identity.enroll import BENCH_ECHO_IDENTITY
from servemesh.identity.store import MeshIdentity
from servemesh.services.model.app import SERVICE_NAME, build_server
from servemesh.services.model.artifacts import as_format
from servemesh.services.model.loader import LoadedModel, ModelLoader, load_model
from servemesh.services.model.tensors import Signature, TensorSig
from servemesh.services.runtime import ServiceServer
from servemesh.spec import (
    BatchingSpec,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    Replicas,
    ResolvedSpec,
    SandboxSpec,
    resolve,
)
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

VERSION = "v1"


def bench_instance(spec: ResolvedSpec) -> str:
    """The bench spec's one model server (model-<model>-zone-a-0)."""
    return next(i.name for i in spec.instances() if i.service == "model")


SIGNATURE = Signature(
    input=TensorSig("features", "FP32", (-1, N_FEATURES)),
    output=TensorSig("score", "FP32", (-1, 1)),
)


def pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def bench_spec(batching: BatchingSpec, model: BenchModel, sandbox: bool = True) -> ResolvedSpec:
    """One model server in one zone, hosting `model` v1 with `batching`, on free ports
    (`sandbox` False: without its own walls, to measure what they cost)."""
    return resolve(
        MeshSpec(
            sandbox=SandboxSpec(syscall_filter=sandbox),
            zones=["zone-a"],
            ports=Ports.free(),
            model_servers=Replicas(per_zone={"zone-a": 1}),
            gateway=Replicas(per_zone={"zone-a": 1}),
            feature=Replicas(per_zone={"zone-a": 1}),
            models={
                model.name: ModelSpec(
                    versions={VERSION: ModelVersionSpec(source=model.source(1))},
                    traffic={VERSION: 100},
                    batching=batching,
                )
            },
        )
    )


def bench_loader(
    batching: BatchingSpec,
    model: BenchModel,
    inject_latency_ms: float = 0.0,
    artifact: Artifact | None = None,
) -> ModelLoader:
    """Loads `model` (seed 1, or `artifact`: a variant of it), verified and warmed up, as if
    the registry served it.

    `inject_latency_ms` adds a sleep to every batch (the spec's drill knob): a slower model,
    or one on an accelerator, that keeps the model busy without using the CPU.
    """

    artifact = artifact or model.artifact(1)

    async def load(name: str, version: str) -> LoadedModel:
        return await load_model(
            artifact.data,
            model=name,
            version=version,
            sha256=artifact.sha256,
            signature=SIGNATURE,
            format=as_format(artifact.format),
            batching=batching,
            inject_latency_ms=inject_latency_ms,
        )

    return load


class EchoServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers ModelInfer with an answer of the model server's shape, computing nothing."""

    def __init__(self, replica: str, zone: str) -> None:
        self.replica = replica
        self.zone = zone

    async def ModelInfer(  # noqa: N802 (the proto's name)
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        rows = int(request.inputs[0].shape[0]) if request.inputs else 1
        response = oip.ModelInferResponse(
            model_name=request.model_name, model_version=VERSION, id=request.id
        )
        response.parameters[REPLICA_PARAMETER].string_param = self.replica
        response.parameters[ZONE_PARAMETER].string_param = self.zone
        response.outputs.add(name="score", datatype="FP32", shape=[rows, 1])
        response.raw_output_contents.append(bytes(4 * rows))
        return response


async def serve(
    kind: str,
    batching: BatchingSpec,
    port_file: Path,
    inject_latency_ms: float = 0.0,
    model: BenchModel = BENCH_MODELS["demo"],
    variant: str = "",
    artifact_file: Path | None = None,
    tls: tuple[Path, str] | None = None,
    sandbox: bool = True,
) -> None:
    spec = bench_spec(batching, model, sandbox)
    instance = bench_instance(spec)
    if kind == "model":
        artifact = read_artifact(artifact_file) if artifact_file else model.artifact(1, variant)
        loader = bench_loader(batching, model, inject_latency_ms, artifact)
        server = await build_server(spec, instance, loader=loader, tls=False, confined=True)
        ports = {
            "port": 0,
            "metrics_port": spec.metrics_ports[instance],
            "artifact_bytes": artifact.size,
        }
    else:
        credentials = None
        if tls is not None:
            # Mutual TLS with a certificate of a running mesh's CA: what TLS costs a call.
            credentials = server_credentials(MeshIdentity(tls[0], tls[1]), BENCH_ECHO_IDENTITY)
        server = ServiceServer(
            instance, host=spec.host, port=spec.port_of(instance), credentials=credentials
        )
        server.add_service(
            grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
            EchoServicer(instance, "zone-a"),
            SERVICE_NAME,
        )
        ports = {"port": 0, "metrics_port": 0}
    ports["port"] = await server.start()
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(ports))
    tmp.replace(port_file)
    await server.serve_until_signalled()


def read_artifact(path: Path) -> Artifact:
    """An artifact another process built (a variant derived once by the bench, so this
    server's memory holds only what serving it takes)."""
    from servemesh.services.model.artifacts import detect_format

    data = path.read_bytes()
    return Artifact(data, hashlib.sha256(data).hexdigest(), detect_format(data))


def ceiling(
    seconds: float, max_batch: int, model: BenchModel = BENCH_MODELS["demo"]
) -> dict[str, Any]:
    """The model in-process: forward passes alone, then the batcher without gRPC (enforcing
    deadlines, as served, and deadline-blind)."""
    from servemesh.services.model.batching import Batcher
    from servemesh.services.model.runner import ModelRunner

    artifact = model.artifact(1)
    runner = ModelRunner.from_bytes(
        artifact.data,
        sha256=artifact.sha256,
        model=model.name,
        version=VERSION,
        format=as_format(artifact.format),
        row_shape=(N_FEATURES,),
        output_row_shape=(1,),
        max_batch_size=max_batch,
    )
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    for size in (1, max_batch):
        batch = rng.normal(size=(size, N_FEATURES)).astype(np.float32)
        runner.warm_up([size])
        calls = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds / 3:
            runner.run(batch)
            calls += 1
        elapsed = time.perf_counter() - started
        results[f"forward_b{size}"] = {
            "rows_per_s": round(calls * size / elapsed, 1),
            "ms_per_call": round(elapsed / calls * 1000, 4),
        }

    async def through_batcher(
        concurrency: int, deadline_policy: Literal["enforce", "ignore"]
    ) -> dict[str, Any]:
        spec = BatchingSpec(max_batch_size=max_batch, deadline_policy=deadline_policy)
        batcher = Batcher(runner, spec, name="ceiling")
        await batcher.warm_up([1, max_batch])
        rows = [rng.normal(size=(1, N_FEATURES)).astype(np.float32) for _ in range(256)]
        done = 0
        # One stop for every caller, flipped by the loop between callbacks: the callers one
        # batch answered all resume on the same side of it, so the run's end leaves no
        # batch part-filled by some of them stopping and others going on.
        stopping = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds / 3, stopping.set)

        async def caller(offset: int) -> None:
            nonlocal done
            i = offset
            while not stopping.is_set():
                await batcher.submit(rows[i % 256], time.monotonic() + 5, "bench")
                done += 1
                i += concurrency

        started = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
        await batcher.close()
        stats = batcher.stats
        return {
            "concurrency": concurrency,
            "deadline_policy": deadline_policy,
            "req_per_s": round(done / elapsed, 1),
            "mean_batch": round(stats.inference_count / max(stats.executions, 1), 2),
        }

    if artifact.format == "onnx":
        results.update(onnxruntime_alone(artifact.data, seconds, max_batch))
    # The same batcher deadline-blind: what enforcing deadlines (a timer per request, earliest
    # deadline first, the door check) costs per request, with no gRPC around it.
    results["batcher_c64"] = asyncio.run(through_batcher(64, "enforce"))
    results["batcher_c64_ignore"] = asyncio.run(through_batcher(64, "ignore"))
    return results


def onnxruntime_alone(data: bytes, seconds: float, max_batch: int) -> dict[str, Any]:
    """The floor under an ONNX model: its onnxruntime session called straight, no runner,
    batcher or gRPC, with the session options a model server uses (one intra-op thread)."""
    import onnxruntime  # type: ignore[import-untyped]

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    [name] = [value.name for value in session.get_inputs()]
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    for size in (1, max_batch):
        batch = {name: rng.normal(size=(size, N_FEATURES)).astype(np.float32)}
        for _ in range(3):
            session.run(None, batch)
        calls = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds / 3:
            session.run(None, batch)
            calls += 1
        elapsed = time.perf_counter() - started
        results[f"onnxruntime_b{size}"] = {
            "rows_per_s": round(calls * size / elapsed, 1),
            "ms_per_call": round(elapsed / calls * 1000, 4),
        }
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m servemesh.bench.model.targets")
    parser.add_argument("kind", choices=["model", "echo", "ceiling"])
    parser.add_argument("--batching", default="{}", help="BatchingSpec fields as JSON")
    parser.add_argument("--cpu", type=int, help="pin the process to this CPU")
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--inject-latency-ms", type=float, default=0.0)
    parser.add_argument("--model", choices=sorted(BENCH_MODELS), default="demo")
    parser.add_argument(
        "--variant", choices=VARIANTS, help="serve the model's derived form (int8: quantized)"
    )
    parser.add_argument(
        "--artifact-file", type=Path, help="serve this artifact of the model (e.g. a variant)"
    )
    parser.add_argument(
        "--tls-state-dir",
        type=Path,
        help=f"echo: serve mutual TLS as {BENCH_ECHO_IDENTITY!r}, of this mesh state dir's CA",
    )
    parser.add_argument("--tls-mesh", default="", help="the mesh name its certificates carry")
    parser.add_argument(
        "--no-sandbox", action="store_true", help="model: serve without the syscall filter"
    )
    args = parser.parse_args(argv)
    pin(args.cpu)
    batching = BatchingSpec(**json.loads(args.batching))
    model = BENCH_MODELS[args.model]
    if args.kind == "ceiling":
        print(json.dumps(ceiling(args.seconds, batching.max_batch_size, model)))
        return
    if args.port_file is None:
        parser.error("--port-file is required for a server")
    asyncio.run(
        serve(
            args.kind,
            batching,
            args.port_file,
            args.inject_latency_ms,
            model,
            args.variant or "",
            args.artifact_file,
            (args.tls_state_dir, args.tls_mesh) if args.tls_state_dir else None,
            sandbox=not args.no_sandbox,
        )
    )


if __name__ == "__main__":
    main()
