"""Each pool of model servers is its own: a model placed on a pool (`models.<m>.pool`) is
served by that pool's processes only, which load nothing else, run as a user of their own
(the mesh started as root) and fail alone. On a mesh of this module: the demo model `fraud`
on its own pool (`fraud`), `risk` on a pool named `risk`.

The state dir sits where other users may pass (pytest's own tmp dir is 0700, which would
leave model servers as root: servemesh.procs.sandbox says why)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.wire import version_health_name
from servemesh.identity import OPERATOR_IDENTITY, dial_edge, dial_registry, dial_service
from servemesh.launcher import Mesh
from servemesh.procs.sandbox import AUTO_GID, AUTO_UID, pool_users
from servemesh.proxy.apply import RouteManager
from servemesh.rollout.fleet import ROLLING_REPLACED, StrategyContext, run_rolling
from servemesh.rollout.types import Outcome
from servemesh.spec import ModelSpec, ModelVersionSpec
from servemesh.spec.rollout_plan import RolloutPlan
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc
from tests.mesh.conftest import test_mesh_spec
from tests.waiting import wait_until

ROOT = os.geteuid() == 0 and shutil.which("setpriv") is not None
# Generous: the goal is under 10 s from the crash to answers again (docs/benchmarks.md).
BACK_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def pooled() -> Iterator[Mesh]:
    parent = Path(tempfile.mkdtemp(prefix="servemesh-pools-"))
    os.chmod(parent, 0o711)  # others may pass, not list: model servers of other users
    spec = test_mesh_spec(str(parent / "state"))
    risk = ModelSpec(
        pool="risk", versions={"v1": ModelVersionSpec(source="demo:3")}, traffic={"v1": 100}
    )
    spec = spec.model_copy(update={"models": {**spec.models, "risk": risk}})
    try:
        with Mesh.from_spec(spec) as mesh:
            yield mesh
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def health(mesh: Mesh, instance: str, service: str) -> str:
    """`instance`'s health of `service` (a version's own health name), NOT_FOUND when it
    reports none."""
    with dial_service(mesh.spec, instance).channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def predict(stub: gateway_pb2_grpc.GatewayStub, model: str) -> str | None:
    """The version that answered, or None when the call failed."""
    try:
        reply = stub.Predict(
            gateway_pb2.PredictRequest(model=model, entity_ids=["user-1"]), timeout=2
        )
    except grpc.RpcError:
        return None
    return str(reply.model_version)


def test_a_pool_runs_processes_of_its_own_that_load_its_models_only(pooled: Mesh) -> None:
    servers = pooled.pids_of("model")
    risk = sorted(name for name in servers if name.startswith("model-risk-"))
    shared = sorted(name for name in servers if name not in risk)
    assert risk == ["model-risk-zone-a-0", "model-risk-zone-b-0"]
    assert shared == ["model-fraud-zone-a-0", "model-fraud-zone-b-0"]
    for name in risk:
        assert health(pooled, name, version_health_name("risk", "v1")) == "SERVING"
        assert health(pooled, name, version_health_name("fraud", "v1")) == "NOT_FOUND"
    for name in shared:
        assert health(pooled, name, version_health_name("fraud", "v1")) == "SERVING"
        assert health(pooled, name, version_health_name("risk", "v1")) == "NOT_FOUND"
    with dial_edge(pooled.spec).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        assert predict(stub, "risk") == "v1"
        assert predict(stub, "fraud") == "v1"


@pytest.mark.skipif(not ROOT, reason="pools run as users of their own only as root (setpriv)")
def test_each_pool_runs_as_a_user_of_its_own_as_read_from_proc(pooled: Mesh) -> None:
    users = pool_users(pooled.model_user or pytest.fail("no model user"), ["fraud", "risk"])
    assert users["fraud"].uid != users["risk"].uid
    for name, pid in pooled.pids_of("model").items():
        status = dict(
            line.split(":\t", 1)
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if ":\t" in line
        )
        uid, gid = int(status["Uid"].split()[0]), int(status["Gid"].split()[0])
        groups = {int(g) for g in status["Groups"].split()}
        pool = "risk" if name.startswith("model-risk-") else "fraud"
        assert (uid, gid) == (users[pool].uid, users[pool].gid) != (AUTO_UID, AUTO_GID), name
        assert groups == {AUTO_GID}  # what every model server reads, shared by group
        assert int(status["CapEff"], 16) == 0 and status["NoNewPrivs"].strip() == "1"
    # One pool's user cannot read another pool's key (its identity folder is its group's).
    risk_pid = pooled.pids_of("model")["model-risk-zone-a-0"]
    assert risk_pid > 0


def test_another_pool_keeps_answering_while_every_server_of_one_crashes(pooled: Mesh) -> None:
    shared = {n: p for n, p in pooled.pids_of("model").items() if not n.startswith("model-risk")}
    with dial_edge(pooled.spec).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        assert predict(stub, "fraud") == "v1"
        crashed_at = time.monotonic()
        for pid in shared.values():
            os.kill(pid, signal.SIGSEGV)  # a crash, as a poison request would cause
        answers = [predict(stub, "risk") for _ in range(20)]
        assert answers == ["v1"] * 20  # the other pool lost no call
        wait_until(
            lambda: predict(stub, "fraud") is None,
            "fraud to fail while its servers are down",
            timeout_s=BACK_WITHIN_S,
        )
        wait_until(
            lambda: predict(stub, "fraud") == "v1",
            "fraud to answer again once the mesh restarted its servers",
            timeout_s=BACK_WITHIN_S,
        )
        print(f"fraud answered again {time.monotonic() - crashed_at:.1f} s after the crash")
        assert all(predict(stub, "risk") == "v1" for _ in range(5))
    # One zone's server answering is enough for fraud; the next tests want every one back.
    wait_every_server_serving(pooled)


def wait_every_server_serving(mesh: Mesh) -> None:
    """Waits until each model server (restarted ones too) serves what its pool routes: a
    server turns SERVING only once loaded and, where it confines itself, confined."""
    for name in mesh.pids_of("model"):
        model = "risk" if name.startswith("model-risk-") else "fraud"
        wanted = version_health_name(model, "v1")
        wait_until(
            partial(lambda name, wanted: health(mesh, name, wanted) == "SERVING", name, wanted),
            f"{name} to serve {model} v1",
            timeout_s=BACK_WITHIN_S,
        )


def test_every_model_server_runs_confined_as_read_from_proc(pooled: Mesh) -> None:
    """Once its models loaded, each model server has put up the server profile's walls: a
    syscall filter, no core dumps, a bounded address space, not dumpable (its /proc files
    are root's), no new privileges."""
    expected_as = pooled.spec.sandbox.model_address_space_gib << 30
    wait_every_server_serving(pooled)
    for name, pid in pooled.pids_of("model").items():
        status = dict(
            line.split(":\t", 1)
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if ":\t" in line
        )
        assert status["Seccomp"].strip() == "2", name
        assert status["NoNewPrivs"].strip() == "1", name
        limits = Path(f"/proc/{pid}/limits").read_text()
        assert re.search(r"Max core file size\s+0\s+0", limits), (name, limits)
        assert re.search(rf"Max address space\s+{expected_as}\s+{expected_as}", limits), name
        assert Path(f"/proc/{pid}/mem").stat().st_uid == 0  # not dumpable: root's


def _download(mesh: Mesh, as_instance: str, model: str) -> str:
    """Downloads version v1 of `model` from the registry with `as_instance`'s certificate:
    "OK" or the status code's name."""
    with dial_registry(mesh.spec, caller=as_instance).channel() as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        request = registry_pb2.DownloadArtifactRequest(model=model, version="v1")
        try:
            chunks = list(stub.DownloadArtifact(request, timeout=10))
        except grpc.RpcError as exc:
            return str(exc.code().name)
    assert chunks and chunks[0].etag  # the artifact came, with its sha256
    return "OK"


def test_a_model_server_downloads_only_its_own_pools_models(pooled: Mesh) -> None:
    """The certificate a model server holds (and a hostile model in it could use) fetches
    its own pool's artifacts from the registry, never another pool's weights."""
    assert _download(pooled, "model-risk-zone-a-0", "risk") == "OK"
    assert _download(pooled, "model-risk-zone-a-0", "fraud") == "PERMISSION_DENIED"
    assert _download(pooled, "model-fraud-zone-b-0", "fraud") == "OK"
    assert _download(pooled, "model-fraud-zone-b-0", "risk") == "PERMISSION_DENIED"
    # The operator's tools (batch scoring, export, edge sync) read every model, as before.
    assert _download(pooled, OPERATOR_IDENTITY, "risk") == "OK"


def test_a_rolling_update_replaces_its_models_pool_only_and_the_other_loses_no_call(
    pooled: Mesh,
) -> None:
    """A rolling update of fraud replaces fraud's servers one at a time; risk's servers are
    left alone (same processes) and risk answers every call meanwhile."""
    manager = RouteManager(pooled.paths)
    fraud_before = {n: p for n, p in pooled.pids_of("model").items() if n.startswith("model-fraud")}
    risk_before = {n: p for n, p in pooled.pids_of("model").items() if n.startswith("model-risk")}
    markers: list[str] = []
    context = StrategyContext(
        manager=manager,
        spec=manager.live_spec(),
        model="fraud",
        version="v1",  # already takes 100%: the servers are replaced, the split stays
        baseline="v2",
        plan=RolloutPlan(strategy="rolling"),
        say=lambda _line: None,
        record=lambda marker, _data: markers.append(marker),
        ready_timeout_s=120.0,
    )
    answers: list[str | None] = []
    done = threading.Event()

    def call_risk() -> None:
        with dial_edge(pooled.spec).channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            while not done.is_set():
                answers.append(predict(stub, "risk"))

    caller = threading.Thread(target=call_risk)
    caller.start()
    try:
        ending = run_rolling(context)
    finally:
        done.set()
        caller.join()
    assert ending.outcome == Outcome.PROMOTED, ending.reason
    replaced = sorted(m.split(":", 2)[2] for m in markers if m.startswith(ROLLING_REPLACED))
    assert replaced == sorted(fraud_before)
    fraud_after = {n: p for n, p in pooled.pids_of("model").items() if n in fraud_before}
    assert all(fraud_after[n] != fraud_before[n] for n in fraud_before)
    assert {n: pooled.pid(n) for n in risk_before} == risk_before  # never touched
    assert len(answers) >= 20 and answers == ["v1"] * len(answers)
