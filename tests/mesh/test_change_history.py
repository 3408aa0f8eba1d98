"""Operator changes cannot lie, through the session mesh's real Envoy: a change Envoy does
not confirm is undone (files back, resolved spec untouched) and recorded as failed; a torn
history line breaks neither `routes history` nor `rollback`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from servemesh.identity import dial_edge
from servemesh.launcher import Mesh, envoy_child
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.apply import APPLIED, FAILED, RouteManager
from servemesh.state.paths import ApplyError
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.envoys import zone_admin
from tests.waiting import wait_until

START = {"v1": 100, "v2": 0, "v3": 0}


@pytest.fixture
def admin(mesh: Mesh) -> AdminClient:
    """Zone-a's Envoy: it holds the model routes zone-a's callers use."""
    return zone_admin(mesh, "zone-a")


@pytest.fixture
def routes(mesh: Mesh) -> Iterator[RouteManager]:
    manager = RouteManager(mesh.paths)
    yield manager
    # Later tests share the mesh: leave fraud as the session spec routes it.
    if manager.live_spec().models["fraud"].traffic != START:
        manager.set_weights("fraud", START)


def _xds(mesh: Mesh) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in mesh.state_dir.glob("xds*/**/*.yaml")}


def _predicts(mesh: Mesh) -> bool:
    try:
        with dial_edge(mesh.spec).channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            stub.Predict(
                gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"]), timeout=2
            )
        return True
    except grpc.RpcError:
        return False


def test_a_change_envoy_never_confirms_is_undone_and_recorded_as_failed(
    mesh: Mesh, routes: RouteManager, admin: AdminClient
) -> None:
    files = _xds(mesh)
    spec_text = mesh.paths.resolved_spec.read_bytes()
    served = admin.served_versions().routes
    impatient = RouteManager(mesh.paths, confirm_timeout_s=0.5)
    # By PID: the Envoy holding zone-a's routes cannot confirm anything.
    stalled = envoy_child(mesh.spec.proxy_of_zone("zone-a"))
    mesh.send_signal(stalled, signal.SIGSTOP)
    try:
        with pytest.raises(ApplyError) as refused:
            impatient.set_weights("fraud", {"v1": 50, "v2": 50})
    finally:
        mesh.send_signal(stalled, signal.SIGCONT)
    assert "previous xDS files were restored" in str(refused.value)
    assert "live spec is unchanged" in str(refused.value)
    assert _xds(mesh) == files
    assert mesh.paths.resolved_spec.read_bytes() == spec_text
    last = routes.history()[-1]
    assert last["status"] == FAILED and last["action"] == "set fraud v1=50 v2=50 v3=0"
    assert "restored" in last["error"]
    # Envoy, running again, serves what it served before (the restored files' version).
    wait_until(lambda: admin.served_versions().routes == served, "Envoy back on the old routes")
    wait_until(lambda: _predicts(mesh), "predictions through the edge again", timeout_s=60)
    # A failed entry is not something to roll back.
    with pytest.raises(ApplyError, match="no applied history entry|nothing to roll back"):
        routes.rollback(int(last["id"]))


def test_a_change_is_pending_before_the_swap_and_applied_after(
    mesh: Mesh, routes: RouteManager
) -> None:
    result = routes.set_weights("fraud", {"v1": 90, "v2": 10})
    entries = [
        json.loads(line)
        for line in mesh.paths.history.read_text().splitlines()
        if line.strip().startswith("{") and f'"id": {result.entry_id},' in line
    ]
    assert [e["status"] for e in entries] == ["pending", "applied"]
    assert routes.history()[-1]["status"] == APPLIED


def test_a_torn_history_line_breaks_neither_history_nor_rollback(
    mesh: Mesh, routes: RouteManager
) -> None:
    routes.set_weights("fraud", {"v1": 70, "v2": 30})
    with mesh.paths.history.open("a") as handle:
        handle.write('{"id": 99, "status": "app')  # a crash mid-write
    torn_line = len(mesh.paths.history.read_text().splitlines())

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "servemesh",
                "routes",
                "--state-dir",
                str(mesh.state_dir),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    shown = cli("history", "--json")
    assert shown.returncode == 0, shown.stderr
    assert f"line {torn_line}" in shown.stderr
    assert json.loads(shown.stdout)[-1]["action"] == "set fraud v1=70 v2=30 v3=0"
    rolled = cli("rollback")
    assert rolled.returncode == 0, rolled.stderr
    assert routes.live_spec().models["fraud"].traffic == START
    # The rollback's own entries start on a line of their own, after the torn one.
    assert routes.history()[-1]["action"].startswith("rollback of #")
