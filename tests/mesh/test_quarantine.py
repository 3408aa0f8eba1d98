"""A version whose calls keep crashing its model servers is quarantined. On a mesh of this
module: the demo model `fraud` on the shared model servers, `risk` on a pool of its own with
v1 and v2 sharing its traffic; v2 takes 500 ms a batch (`inject_latency_ms`), so a call to
it stays in the forward pass long enough to be caught there.

No model may crash its server on purpose (the guard refuses anything that could), so the
crash comes from outside: once the trigger call shows in the replica's in-flight journal,
the test sends SIGSEGV to the replica's PID, which is exactly "a crash with this call in
flight". Two such crashes within the window (`sandbox.quarantine: {crashes: 2}`) and v2's
traffic moves to v1 through the route manager.

v3 takes a minute a batch (no traffic: only this module's calls reach it), far past this
mesh's stall limit (`sandbox.liveness: {stall: 2s}`): one call to it leaves its server alive
and of no use, and the mesh's liveness checks must kill and restart it.

The state dir sits where other users may pass (see tests/mesh/test_pools.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from servemesh.cli import main
from servemesh.contract.inflight import journal_path, read_inflight
from servemesh.contract.wire import REQUEST_ID_HEADER
from servemesh.identity import dial_edge, dial_service
from servemesh.launcher import Mesh
from servemesh.procs import GrpcHealth
from servemesh.quarantine import QuarantineState, read_crashes
from servemesh.spec import (
    LivenessSpec,
    ModelSpec,
    ModelVersionSpec,
    QuarantineSpec,
    load_resolved,
)
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.mesh.conftest import test_mesh_spec
from tests.waiting import wait_until

VICTIM = "model-risk-zone-a-0"
# Generous: a crashed server is back in a few seconds (its backoff, then torch's imports).
BACK_WITHIN_S = 90.0
TRIGGER = np.full((1, 64), 13.0, dtype=np.float32)
# v3's every batch: a model thread stuck in one call, as far as the mesh can tell.
STUCK_MS = 60_000


@pytest.fixture(scope="module")
def crashing() -> Iterator[Mesh]:
    parent = Path(tempfile.mkdtemp(prefix="servemesh-quarantine-"))
    os.chmod(parent, 0o711)  # others may pass, not list: model servers of other users
    spec = test_mesh_spec(str(parent / "state"))
    risk = ModelSpec(
        pool="risk",
        versions={
            "v1": ModelVersionSpec(source="demo:3"),
            "v2": ModelVersionSpec(source="demo:4", inject_latency_ms=500),
            "v3": ModelVersionSpec(source="demo:4", inject_latency_ms=STUCK_MS),
        },
        traffic={"v1": 50, "v2": 50, "v3": 0},
    )
    sandbox = spec.sandbox.model_copy(
        update={
            "quarantine": QuarantineSpec(crashes=2, within="5m"),
            "liveness": LivenessSpec(stall="2s", period="1s", timeout="2s", failures=3),
        }
    )
    spec = spec.model_copy(update={"models": {**spec.models, "risk": risk}, "sandbox": sandbox})
    try:
        with Mesh.from_spec(spec) as mesh:
            yield mesh
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def serving(mesh: Mesh, name: str) -> bool:
    health = GrpcHealth(dial_service(mesh.spec, name))
    try:
        return health.check()
    finally:
        health.close()


def predict(stub: gateway_pb2_grpc.GatewayStub, model: str) -> str | None:
    """The version that answered, or None when the call failed."""
    try:
        reply = stub.Predict(
            gateway_pb2.PredictRequest(model=model, entity_ids=["user-1"]), timeout=5
        )
    except grpc.RpcError:
        return None
    return str(reply.model_version)


def in_flight(mesh: Mesh, request_id: str) -> bool:
    batches = read_inflight(journal_path(mesh.state_dir, VICTIM))
    return any(c["request_id"] == request_id for b in batches for c in b["calls"])


def crash_with_call_in_flight(mesh: Mesh, request_id: str) -> dict[str, Any]:
    """Send the trigger call to v2 on the victim, SIGSEGV the victim while the call is in
    its forward pass; the crash record the mesh wrote for it."""
    wait_until(lambda: serving(mesh, VICTIM), f"{VICTIM} SERVING", timeout_s=BACK_WITHIN_S)
    pid = mesh.pid(VICTIM)
    request = oip.ModelInferRequest(model_name="risk", model_version="v2")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 64])
    request.raw_input_contents.append(TRIGGER.tobytes())
    with dial_service(mesh.spec, VICTIM).channel() as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelInfer.future(
            request, metadata=[(REQUEST_ID_HEADER, request_id)], timeout=30
        )
        wait_until(lambda: in_flight(mesh, request_id), f"{request_id} in {VICTIM}'s journal")
        os.kill(pid, signal.SIGSEGV)
        with pytest.raises(grpc.RpcError):
            call.result()
    return wait_until(
        lambda: next(
            (
                r
                for r in read_crashes(mesh.state_dir)
                if any(c["request_id"] == request_id for c in r["inflight"])
            ),
            None,
        ),
        f"the crash record naming {request_id}",
        timeout_s=BACK_WITHIN_S,
    )


def cli_out(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_a_version_whose_calls_keep_crashing_its_servers_is_quarantined(
    crashing: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    mesh = crashing
    state = ["--state-dir", str(mesh.state_dir)]
    # The other pool's model is called all along: it must lose no call.
    fraud_answers: list[str | None] = []
    stop = threading.Event()

    def call_fraud() -> None:
        with dial_edge(mesh.spec).channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            while not stop.is_set():
                fraud_answers.append(predict(stub, "fraud"))

    caller = threading.Thread(target=call_fraud, name="fraud-caller")
    caller.start()
    try:
        first = crash_with_call_in_flight(mesh, "trigger-1")
        assert first["instance"] == VICTIM and first["pool"] == "risk"
        assert first["exit"] == -signal.SIGSEGV and first["exit_text"] == "SIGSEGV"
        (call,) = [c for c in first["inflight"] if c["request_id"] == "trigger-1"]
        assert call["model"] == "risk" and call["version"] == "v2"
        assert call["sha256"] == hashlib.sha256(TRIGGER.tobytes()).hexdigest()
        assert call["caller"]  # the call's peer
        # One crash is not enough: v2 keeps its traffic.
        assert QuarantineState.read(mesh.state_dir).quarantined == {}
        assert mesh.spec.models["risk"].traffic == {"v1": 50, "v2": 50, "v3": 0}

        crash_with_call_in_flight(mesh, "trigger-2")
        entry = wait_until(
            lambda: QuarantineState.read(mesh.state_dir).quarantined.get(("risk", "v2")),
            "risk v2 quarantined",
            timeout_s=BACK_WITHIN_S,
        )
        assert entry["traffic_to"] == "v1"
        live = load_resolved(mesh.resolved_spec_path)
        assert live.models["risk"].traffic == {"v1": 100, "v2": 0, "v3": 0}
        wait_until(lambda: serving(mesh, VICTIM), f"{VICTIM} back", timeout_s=BACK_WITHIN_S)
        with dial_edge(mesh.spec).channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            assert [predict(stub, "risk") for _ in range(10)] == ["v1"] * 10
    finally:
        stop.set()
        caller.join()
    assert fraud_answers and fraud_answers == ["v1"] * len(fraud_answers)
    print(f"fraud answered {len(fraud_answers)} of {len(fraud_answers)} calls meanwhile")

    history = json.loads(cli_out(capsys, "routes", "history", *state, "--json"))
    (change,) = [e for e in history if e.get("who") == "quarantine"]
    assert change["status"] == "applied"
    assert change["action"].startswith("set risk v1=100 v2=0 v3=0 (quarantine: risk v2")

    shown = cli_out(capsys, "models", "show", "risk", *state)
    assert "yes, since" in shown and "trigger-1" in shown and "trigger-2" in shown
    assert hashlib.sha256(TRIGGER.tobytes()).hexdigest() in shown
    facts = json.loads(cli_out(capsys, "models", "show", "risk", *state, "--json"))
    quarantined = {v["version"]: v["quarantine"] is not None for v in facts["versions"]}
    assert quarantined == {"v1": False, "v2": True, "v3": False}

    released = cli_out(capsys, "models", "release", "risk", "v2", *state)
    assert "not moved back" in released
    assert QuarantineState.read(mesh.state_dir).quarantined == {}
    traffic = load_resolved(mesh.resolved_spec_path).models["risk"].traffic
    assert traffic == {"v1": 100, "v2": 0, "v3": 0}
    capsys.readouterr()
    assert main(["models", "release", "risk", "v2", *state]) != 0  # not quarantined now


def stuck_call(mesh: Mesh, instance: str, request_id: str) -> grpc.Future:
    """A call to v3 straight to `instance` (a minute in its model thread), not yet answered."""
    request = oip.ModelInferRequest(model_name="risk", model_version="v3")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 64])
    request.raw_input_contents.append(np.zeros((1, 64), dtype=np.float32).tobytes())
    channel = dial_service(mesh.spec, instance).channel()
    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
    call = stub.ModelInfer.future(
        request, metadata=[(REQUEST_ID_HEADER, request_id)], timeout=STUCK_MS / 1000 + 30
    )
    call.add_done_callback(lambda _: channel.close())
    return call


def test_a_model_server_stuck_in_a_call_is_killed_and_started_again(
    crashing: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    mesh = crashing
    wait_until(lambda: serving(mesh, VICTIM), f"{VICTIM} SERVING", timeout_s=BACK_WITHIN_S)
    pid = mesh.pid(VICTIM)
    restarts = mesh.restart_counts().get(VICTIM, 0)
    call = stuck_call(mesh, VICTIM, "stuck-1")
    wait_until(lambda: in_flight(mesh, "stuck-1"), f"stuck-1 in {VICTIM}'s journal")
    # Its process is killed long before v3's minute is up: the call fails, not answers.
    with pytest.raises(grpc.RpcError) as failed:
        call.result()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_until(
        lambda: mesh.restart_counts().get(VICTIM, 0) == restarts + 1,
        f"{VICTIM} started again",
        timeout_s=BACK_WITHIN_S,
    )
    wait_until(lambda: serving(mesh, VICTIM), f"{VICTIM} back", timeout_s=BACK_WITHIN_S)
    assert mesh.pid(VICTIM) != pid

    state = ["--state-dir", str(mesh.state_dir)]
    rows = {r["replica"]: r for r in json.loads(cli_out(capsys, "fleet", "show", *state, "--json"))}
    assert rows[VICTIM]["last_exit"] == -signal.SIGKILL
    assert rows[VICTIM]["last_cause"].startswith("liveness: 3 liveness checks failed in a row")
    assert "SIGKILL (liveness)" in cli_out(capsys, "fleet", "show", *state)
    # Recorded as a crash with its call in flight, like any other.
    (record,) = [
        r
        for r in read_crashes(mesh.state_dir)
        if any(c["request_id"] == "stuck-1" for c in r["inflight"])
    ]
    assert record["instance"] == VICTIM and record["exit"] == -signal.SIGKILL


def test_a_paused_model_server_is_not_killed_for_liveness(crashing: Mesh) -> None:
    """SIGSTOP is a pause (a drill's, an operator's), not a hang: the liveness watch leaves
    the process alone however many rounds it stays stopped."""
    mesh = crashing
    paused = "model-risk-zone-b-0"
    wait_until(lambda: serving(mesh, paused), f"{paused} SERVING", timeout_s=BACK_WITHIN_S)
    watch = mesh.liveness
    assert watch is not None
    pid = mesh.pid(paused)
    restarts = mesh.restart_counts().get(paused, 0)
    os.kill(pid, signal.SIGSTOP)
    try:
        # Twice the rounds that would kill a hung one, counted from the first round that
        # began after the pause.
        rounds = watch.rounds + 1 + 2 * watch.policy.failures
        assert watch.wait_rounds(rounds, timeout_s=60), "the liveness watch stopped"
        assert mesh.pid(paused) == pid and mesh.supervisor.child(paused).alive()
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: serving(mesh, paused), f"{paused} answers again", timeout_s=BACK_WITHIN_S)
    assert mesh.pid(paused) == pid
    assert mesh.restart_counts().get(paused, 0) == restarts
