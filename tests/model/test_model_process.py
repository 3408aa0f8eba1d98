"""`python -m servemesh.services.model` as the mesh runs it: a real process that pulls its
artifact from a real registry process, serves metrics, and drains in-flight batches on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from servemesh.contract.control_credential import control_metadata_for, ensure_control_token
from servemesh.contract.demo import demo_artifact
from servemesh.identity import Dial, dial_registry, dial_service
from servemesh.procs import Child, GrpcHealth, Supervisor
from servemesh.registry.client import push_version
from servemesh.spec import (
    BatchingSpec,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    Replicas,
    dump_spec,
    resolve,
)
from servemesh_api.inference import grpc_service_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2
from tests.model.model_helpers import rows
from tests.model.test_model_metrics import scrape, value
from tests.model.test_model_server import infer_request

MODEL_INSTANCE = "model-fraud-zone-a-0"
SLOW_MS = 300.0  # every batch takes this long: requests are surely in flight at SIGTERM


def start_service(
    supervisor: Supervisor, module: str, instance: str, spec_file: Path, dial: Dial
) -> Child:
    """Start a service as the launcher does, and wait until it answers SERVING."""
    argv = [sys.executable, "-m", module, "--spec", str(spec_file), "--instance", instance]
    return supervisor.start(instance, argv, ready=GrpcHealth(dial), timeout_s=60)


async def all_in_flight(metrics_address: str, count: int) -> None:
    """Until `count` single-row requests reached the batcher, a batch is in the model and
    none has been answered: each scrape round trip paces the next."""
    give_up = time.monotonic() + 30
    while True:
        samples = await asyncio.to_thread(scrape, metrics_address)
        queued = value(samples, "servemesh_model_queue_depth")
        dispatched = value(samples, "servemesh_model_batch_size_sum")  # rows sent to the model
        answered = value(samples, "servemesh_model_inferences_total")
        assert answered == 0, "a batch finished before the drain began"
        if queued + dispatched == count and dispatched >= 1:
            return
        assert time.monotonic() < give_up, f"requests never all arrived: {samples}"


async def test_model_server_process_drains_in_flight_batches_on_sigterm(tmp_path: Path) -> None:
    spec = resolve(
        MeshSpec(
            zones=["zone-a"],
            ports=Ports.free(),
            state_dir=str(tmp_path / "state"),
            model_servers=Replicas(per_zone={"zone-a": 1}),
            gateway=Replicas(per_zone={"zone-a": 1}),
            feature=Replicas(per_zone={"zone-a": 1}),
            models={
                "fraud": ModelSpec(
                    versions={"v1": ModelVersionSpec(source="demo:1", inject_latency_ms=SLOW_MS)},
                    traffic={"v1": 100},
                    batching=BatchingSpec(max_batch_size=8),
                )
            },
        )
    )
    spec_file = tmp_path / "mesh.yaml"
    spec_file.write_text(dump_spec(spec))
    # What `servemesh up` does first: the services read the control credential at start.
    ensure_control_token(spec.state_dir)
    artifact = demo_artifact(1)

    with Supervisor(tmp_path) as supervisor:
        await asyncio.to_thread(
            start_service,
            supervisor,
            "servemesh.registry",
            "registry-0",
            spec_file,
            dial_registry(spec),
        )
        async with dial_registry(spec).aio_channel() as channel:
            await push_version(
                channel,
                model="fraud",
                version="v1",
                data=artifact.data,
                inputs=[registry_pb2.TensorSpec(name="features", datatype="FP32", shape=[-1, 64])],
                outputs=[registry_pb2.TensorSpec(name="score", datatype="FP32", shape=[-1, 1])],
                credential=control_metadata_for(spec.state_dir),
            )
        model = await asyncio.to_thread(
            start_service,
            supervisor,
            "servemesh.services.model",
            MODEL_INSTANCE,
            spec_file,
            dial_service(spec, MODEL_INSTANCE),
        )
        url = f"http://{spec.metrics_address_of(MODEL_INSTANCE)}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert b"servemesh_model_queue_depth" in reply.read()

        async with dial_service(spec, MODEL_INSTANCE).aio_channel() as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            batches = [rows(1, seed=i) for i in range(6)]
            in_flight = [
                asyncio.ensure_future(stub.ModelInfer(infer_request(b), timeout=10))
                for b in batches
            ]
            # One batch in the model, the rest queued: then the drain begins.
            await all_in_flight(spec.metrics_address_of(MODEL_INSTANCE), len(batches))
            supervisor.send_signal(MODEL_INSTANCE, signal.SIGTERM)
            replies = await asyncio.gather(*in_flight)
            # Every call in flight at SIGTERM was answered, with real scores.
            for reply in replies:
                score = np.frombuffer(reply.raw_output_contents[0], dtype="<f4")
                assert score.shape == (1,) and 0.0 < float(score[0]) < 1.0
        exit_code = await asyncio.to_thread(model.wait, 20)
        text = (tmp_path / f"{MODEL_INSTANCE}.log").read_text()
        assert exit_code == 0, text[-3000:]
        assert '"msg": "draining"' in text and '"msg": "stopped"' in text
