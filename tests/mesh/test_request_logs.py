"""Request log lines, switched on and off in a running mesh with `servemesh apply`."""

from __future__ import annotations

import json
from typing import Any

from servemesh.identity import dial_service
from servemesh.launcher import Mesh
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_apply import LiveApply
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.waiting import wait_until

GATEWAY = "gateway-zone-a-0"


def _log(mesh: Mesh) -> list[dict[str, Any]]:
    lines = (mesh.logs_dir / f"{GATEWAY}.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _spec_changes(mesh: Mesh) -> int:
    return sum(1 for line in _log(mesh) if line.get("msg") == "spec changed")


def _apply(mesh: Mesh, applier: LiveApply, text: str) -> list[str]:
    """Apply `text` and wait until the gateway took it; the plan's lines."""
    taken = _spec_changes(mesh)
    result = applier.apply(text, "logs.yaml")
    wait_until(lambda: _spec_changes(mesh) > taken, "the gateway to take the new spec")
    return result.plan.lines()


def _predict_lines(mesh: Mesh, request_id: str) -> list[dict[str, Any]]:
    return [
        line
        for line in _log(mesh)
        if line.get("msg") == "predict" and line.get("request_id") == request_id
    ]


def test_apply_turns_request_lines_on_and_off_live(mesh: Mesh) -> None:
    applier = LiveApply(RouteManager(mesh.paths, AdminClient.of_mesh(mesh.state_dir)))
    request = gateway_pb2.PredictRequest(model="fraud", version="v1", entity_ids=["user-3"])
    with dial_service(mesh.spec, GATEWAY).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        quiet = stub.Predict(request, timeout=10)
        assert _predict_lines(mesh, quiet.request_id) == []  # the default: no line
        try:
            lines = _apply(mesh, applier, "logs: {requests: true}\n")
            assert lines == ["~ logs: refusals and failures only -> a line per request"]
            logged = stub.Predict(request, timeout=10)
            # The line is written before the answer leaves the gateway.
            (line,) = _predict_lines(mesh, logged.request_id)
            assert line["model"] == "fraud" and line["version"] == "v1"
            assert line["service"] == GATEWAY and line["rows"] == 1
        finally:
            _apply(mesh, applier, "logs: {requests: false}\n")
        after = stub.Predict(request, timeout=10)
        assert _predict_lines(mesh, after.request_id) == []
