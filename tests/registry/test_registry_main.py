"""`python -m servemesh.registry` as the mesh runs it: a real process, health, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.spec import MeshSpec, Ports, dump_spec, resolve_ports
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

# Reconnect quickly while the process is still binding its port.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def wait_serving(channel: grpc.Channel, proc: subprocess.Popen[bytes], log: Path) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, f"registry exited early:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"registry never became SERVING:\n{log.read_text()}"
        try:
            answer = health.Check(
                health_pb2.HealthCheckRequest(service="servemesh.registry.v1.Registry"),
                timeout=0.5,
                wait_for_ready=True,
            )
        except grpc.RpcError:
            continue
        if answer.status == health_pb2.HealthCheckResponse.SERVING:
            return


def test_the_registry_process_serves_then_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    spec = resolve_ports(
        MeshSpec(
            ports=Ports(edge=0, mesh=0, envoy_admin=0, services_base=0),
            state_dir=str(tmp_path / "state"),
        )
    )
    spec_file = tmp_path / "mesh.yaml"
    spec_file.write_text(dump_spec(spec))
    log = tmp_path / "registry.log"

    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "servemesh.registry", "--spec", str(spec_file)]
            + ["--instance", "registry-0"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        with grpc.insecure_channel(spec.registry_address, options=CHANNEL_OPTIONS) as channel:
            wait_serving(channel, proc, log)
            stub = registry_pb2_grpc.RegistryStub(channel)
            assert stub.ListModels(registry_pb2.ListModelsRequest(), timeout=5).models == []
        assert (tmp_path / "state" / "registry" / "registry.db").is_file()

        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=5) == 0, log.read_text()
        assert '"msg": "stopped"' in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
