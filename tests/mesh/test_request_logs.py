"""Request log lines, switched on and off in a running mesh with `servemesh apply`."""

from __future__ import annotations

from servemesh.identity import dial_service
from servemesh.launcher import Mesh
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import apply_live, log_lines

GATEWAY = "gateway-zone-a-0"


def _predict_lines(mesh: Mesh, request_id: str) -> list[dict[str, object]]:
    return [
        line
        for line in log_lines(mesh, GATEWAY)
        if line.get("msg") == "predict" and line.get("request_id") == request_id
    ]


def test_apply_turns_request_lines_on_and_off_live(mesh: Mesh) -> None:
    request = gateway_pb2.PredictRequest(model="fraud", version="v1", entity_ids=["user-3"])
    with dial_service(mesh.spec, GATEWAY).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        quiet = stub.Predict(request, timeout=10)
        assert _predict_lines(mesh, quiet.request_id) == []  # the default: no line
        try:
            lines = apply_live(mesh, "logs: {requests: true}\n", GATEWAY)
            assert lines == ["~ logs: refusals and failures only -> a line per request"]
            logged = stub.Predict(request, timeout=10)
            # The line is written before the answer leaves the gateway.
            (line,) = _predict_lines(mesh, logged.request_id)
            assert line["model"] == "fraud" and line["version"] == "v1"
            assert line["service"] == GATEWAY and line["rows"] == 1
        finally:
            apply_live(mesh, "logs: {requests: false}\n", GATEWAY)
        after = stub.Predict(request, timeout=10)
        assert _predict_lines(mesh, after.request_id) == []
