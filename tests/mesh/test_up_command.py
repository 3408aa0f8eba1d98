"""`servemesh up` as a newcomer runs it: starts everything, answers, stops with nothing left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.policy import EdgeAuth
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import test_mesh_spec


def _port_is_free(host: str, port: int) -> bool:
    """Nothing is bound or listening (connections in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_predictions_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    spec = test_mesh_spec(str(tmp_path / "state"), entities=100)
    # With edge auth on: the CLI finds the mesh's key; a caller without it is refused.
    traffic = spec.traffic.model_copy(update={"edge_auth": EdgeAuth(enabled=True)})
    spec = spec.model_copy(update={"traffic": traffic})
    spec_path = tmp_path / "mesh.yaml"
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    up = subprocess.Popen(
        [sys.executable, "-m", "servemesh", "up", "--spec", str(spec_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    endpoints_file = tmp_path / "state" / "endpoints.json"
    try:
        deadline = time.monotonic() + 180
        while not endpoints_file.exists():
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            assert time.monotonic() < deadline, "servemesh up did not become ready"
            time.sleep(0.1)
        endpoints = json.loads(endpoints_file.read_text())
        credentials = tmp_path / "state" / "edge-credentials"
        assert credentials.stat().st_mode & 0o777 == 0o600
        key = credentials.read_text().strip().split(":", 1)[1]
        assert key not in (tmp_path / "state" / "envoy" / "envoy.static.yaml").read_text()
        with grpc.insecure_channel(endpoints["edge"]) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                gateway_pb2_grpc.GatewayStub(channel).Predict(
                    gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"]), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        predicted = subprocess.run(
            [sys.executable, "-m", "servemesh", "predict", "--model", "fraud",
             "--entity", "user-42", "--address", endpoints["edge"], "--json",
             "--state-dir", str(tmp_path / "state")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert predicted.returncode == 0, predicted.stderr
        answer = json.loads(predicted.stdout)
        assert len(answer["scores"]) == 1 and 0.0 <= answer["scores"][0] <= 1.0
        assert answer["model_version"] == "v1" and answer["request_id"]
    finally:
        up.send_signal(signal.SIGTERM)
        output, _ = up.communicate(timeout=60)
    assert up.returncode == 0, output
    assert "stopped" in output
    pids = endpoints["pids"]
    assert {"redis", "envoy", "registry-0", "gateway-zone-a-0", "model-zone-b-0"} <= set(pids)
    assert not [name for name, pid in pids.items() if _pid_exists(pid)]
    ports = [
        int(a.rsplit(":", 1)[1])
        for a in [
            endpoints["edge"],
            endpoints["mesh"],
            endpoints["envoy_admin"],
            endpoints["redis"].rsplit("/", 1)[0],
            *endpoints["services"].values(),
        ]
    ]
    assert [p for p in ports if not _port_is_free("127.0.0.1", p)] == []
