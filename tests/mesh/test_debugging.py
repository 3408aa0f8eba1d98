"""What someone debugging sees: reflection and health through Envoy, health on every service."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.identity import OPERATOR_IDENTITY, dial_edge, dial_service, mesh_identity
from servemesh.launcher import Mesh

GRPCURL = str(Path(sys.executable).parent / "grpcurl")


def _grpcurl(mesh: Mesh, *args: str) -> str:
    """grpcurl against the edge, trusting the mesh's CA (the edge serves TLS)."""
    trust = str(mesh_identity(mesh.spec).trust_file)
    result = subprocess.run(
        [GRPCURL, "-cacert", trust, *args], capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_grpcurl_lists_and_describes_through_envoy(mesh: Mesh) -> None:
    listed = _grpcurl(mesh, mesh.spec.edge_address, "list").split()
    assert "servemesh.gateway.v1.Gateway" in listed
    assert "grpc.health.v1.Health" in listed
    described = _grpcurl(
        mesh, mesh.spec.edge_address, "describe", "servemesh.gateway.v1.Gateway.Predict"
    )
    assert "PredictRequest" in described and "PredictResponse" in described


def test_grpcurl_can_call_predict_through_envoy(mesh: Mesh) -> None:
    body = '{"model": "fraud", "entity_ids": ["user-42"]}'
    out = _grpcurl(mesh, "-d", body, mesh.spec.edge_address, "servemesh.gateway.v1.Gateway/Predict")
    assert '"model_version": "v1"' in out and '"scores"' in out


def test_every_service_and_the_edge_answer_health_checks(mesh: Mesh) -> None:
    dials = [dial_service(mesh.spec, i.name) for i in mesh.spec.instances()]
    for dial in [*dials, dial_edge(mesh.spec)]:
        with dial.channel() as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, dial.address


def test_every_service_exposes_reflection(mesh: Mesh) -> None:
    """Straight to each replica, grpcurl shows the operator's certificate and checks the
    replica's name (its port is mutual TLS)."""
    identity = mesh_identity(mesh.spec)
    operator = identity.leaf(OPERATOR_IDENTITY)
    for inst in mesh.spec.instances():
        listed = _grpcurl(
            mesh, "-cert", str(operator.cert), "-key", str(operator.key),
            "-servername", f"{inst.name}.{mesh.spec.name}.internal",
            mesh.spec.address_of(inst.name), "list",
        ).split()  # fmt: skip
        assert "grpc.health.v1.Health" in listed, inst.name
        assert len(listed) >= 3, (inst.name, listed)
