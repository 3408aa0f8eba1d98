"""`servemesh apply` on a running mesh: models and versions come and go under load.

A mesh of its own (the demo `fraud` model, v1 takes all traffic). New versions are pushed to
the registry with the registry client first, as `servemesh models push` would.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from servemesh.contract.control_credential import control_metadata_for
from servemesh.contract.demo import demo_artifact, demo_signature
from servemesh.contract.wire import LOAD_VERSION_PARAMETER, message_size_options
from servemesh.identity import dial_edge, dial_registry, dial_service
from servemesh.identity.edge_client import dial_edge_as
from servemesh.launcher import Mesh
from servemesh.load import BackgroundLoad, predict_target
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_apply import LiveApply
from servemesh.registry.client import push_version
from servemesh.spec import DemoSpec, MeshSpec, Ports
from servemesh.state.paths import ApplyError
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.waiting import wait_until

ENTITIES = 300
REPO = Path(__file__).resolve().parents[2]

BASE = """
models:
  fraud:
    versions: {v1: {source: "demo:1"}, v2: {source: "demo:2"}}
    traffic: {v1: 100, v2: 0}
"""
# fraud v3 takes a tenth of the traffic the moment Envoy routes to it; `risk` is a new model
# reading the demo's `user` view.
ADD = """
models:
  fraud:
    versions: {v1: {source: "demo:1"}, v2: {source: "demo:2"}, v3: {}}
    traffic: {v1: 90, v2: 0, v3: 10}
  risk:
    versions: {v1: {}}
    traffic: {v1: 100}
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(tmp_path_factory.mktemp("live-apply")),
        demo=DemoSpec(enabled=True, entities=ENTITIES),
    )
    with Mesh.from_spec(spec) as running:
        asyncio.run(_push_all(running))
        yield running


async def _push(mesh: Mesh, model: str, version: str, data: bytes) -> None:
    options = message_size_options(mesh.spec.limits.max_message_bytes)
    signature = demo_signature()
    async with dial_registry(mesh.spec).aio_channel(options=options) as channel:
        await push_version(
            channel,
            model=model,
            version=version,
            data=data,
            credential=control_metadata_for(mesh.state_dir),
            inputs=signature["inputs"],
            outputs=signature["outputs"],
        )


async def _push_all(mesh: Mesh) -> None:
    await _push(mesh, "fraud", "v3", demo_artifact(3).data)
    await _push(mesh, "risk", "v1", demo_artifact(4).data)
    # Passes the registry's checks (format, digest); no replica can load it.
    await _push(mesh, "fraud", "v8", b"not a TorchScript archive")


@pytest.fixture
def applier(mesh: Mesh) -> LiveApply:
    admin = AdminClient.of_mesh(mesh.state_dir)
    return LiveApply(RouteManager(mesh.paths, admin))


def _spec_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _held(mesh: Mesh, replica: str) -> set[tuple[str, str]]:
    """What a replica serves (READY), from its OIP repository index."""
    with dial_service(mesh.spec, replica).channel() as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        index = stub.RepositoryIndex(oip.RepositoryIndexRequest(ready=True), timeout=5)
    return {(m.name, m.version) for m in index.models}


def _unloaded(mesh: Mesh, replica: str) -> Callable[[], bool]:
    return lambda: ("fraud", "v3") not in _held(mesh, replica)


def _replicas(mesh: Mesh, pool: str = "fraud") -> list[str]:
    """The model servers of a pool as the mesh runs them now."""
    return [i.name for i in mesh.spec.instances() if i.service == "model" and i.pool == pool]


def _state(mesh: Mesh) -> dict[Path, bytes]:
    """Every file a change writes: Envoy's watched files, the resolved spec, the history."""
    files = {p: p.read_bytes() for p in (mesh.state_dir / "xds").rglob("*.yaml")}
    for path in (mesh.paths.resolved_spec, mesh.paths.history):
        if path.is_file():
            files[path] = path.read_bytes()
    return files


def _pinned(
    stub: gateway_pb2_grpc.GatewayStub, model: str, version: str = ""
) -> gateway_pb2.PredictResponse:
    request = gateway_pb2.PredictRequest(model=model, entity_ids=["user-7"], version=version)
    reply: gateway_pb2.PredictResponse = stub.Predict(request, timeout=5)
    return reply


def _wait_answering(mesh: Mesh, model: str, version: str) -> None:
    """Until a pinned Predict through the edge answers from `version` (the gateways take the
    new spec on their next poll of it; until then they don't know the model). As the
    operator: a version the split gives 0% is pinned by operators only."""
    with dial_edge_as(mesh.spec, mesh.spec.edge_address).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def answered() -> bool:
            try:
                return _pinned(stub, model, version).model_version == version
            except grpc.RpcError:
                return False

        wait_until(answered, f"{model} {version} to answer through the edge", every_s=0.02)


def _cli(mesh: Mesh, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "servemesh", "apply", "--state-dir", str(mesh.state_dir), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_dry_run_prints_the_plan_and_changes_nothing(mesh: Mesh, tmp_path: Path) -> None:
    add = _spec_file(tmp_path, "add.yaml", ADD)
    before = _state(mesh)
    dry = _cli(mesh, str(add), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "dry run" in dry.stdout and "risk" in dry.stdout and "fraud v3" in dry.stdout
    assert "v1=90 v2=0 v3=10" in dry.stdout
    assert _state(mesh) == before
    assert all(("fraud", "v3") not in _held(mesh, r) for r in _replicas(mesh))
    refused = _cli(mesh, str(_spec_file(tmp_path, "shrink.yaml", "zones: [zone-a]\n")))
    assert refused.returncode == 1
    assert "refused:" in refused.stderr and "zones" in refused.stderr


def test_models_and_versions_come_and_go_under_load_without_losing_a_request(
    mesh: Mesh, applier: LiveApply, tmp_path: Path
) -> None:
    add = _spec_file(tmp_path, "add.yaml", ADD)
    remove = _spec_file(tmp_path, "remove.yaml", BASE)
    # A 5 s deadline, the mesh's default: on a machine this test shares, a call may wait
    # its turn for a core for a second or two; a lost call is one refused or failed.
    # 100 calls a second: enough that a lost call would show, while the new pool's two
    # servers import torch beside two other suites' meshes on two cores (at 200 the whole
    # box once stalled 6 s, the load generator with it, and four calls ran out of time).
    target = predict_target(dial_edge(mesh.spec), entities=ENTITIES, timeout_s=5.0)
    load = BackgroundLoad(target, rate_per_s=100)
    load.start()
    try:
        wait_until(lambda: len(load.outcomes) >= 100, "a second of steady load")

        fraud_servers = _replicas(mesh)
        added = applier.apply(add.read_text(), str(add))
        assert sorted(added.plan.added_versions) == [("fraud", "v3"), ("risk", "v1")]
        # fraud v3 loads on fraud's own servers; risk, a new model, comes on a pool of its
        # own, whose servers the apply started and waited for.
        assert sorted(r.replica for r in added.loads) == fraud_servers
        assert all(r.loaded == [("fraud", "v3")] for r in added.loads)
        assert added.started == ["model-risk-zone-a-0", "model-risk-zone-b-0"]
        assert _replicas(mesh, "risk") == added.started
        # Every replica loaded and warmed up before Envoy routed to them: the load below
        # loses no call to the change. How soon the gateways follow is their poll's
        # business, not a bound this test could hold on a shared machine.
        _wait_answering(mesh, "fraud", "v3")
        _wait_answering(mesh, "risk", "v1")
        for replica in fraud_servers:
            assert ("fraud", "v3") in _held(mesh, replica)
            assert ("risk", "v1") not in _held(mesh, replica)
        for replica in added.started:
            assert _held(mesh, replica) == {("risk", "v1")}
        assert "+ version fraud v3" in applier.manager.history()[-1]["diff"]
        # Envoy took v3 into the split: some of the load reaches it.
        wait_until(lambda: any(o.version == "v3" for o in load.outcomes), "v3 in the split")

        # Removing v3 while it takes traffic is refused, and nothing changes.
        before = _state(mesh)
        with pytest.raises(ApplyError) as refused:
            applier.apply(remove.read_text(), str(remove), prune=True)
        assert "models.fraud.versions.v3: still takes 10% of traffic" in str(refused.value)
        assert "servemesh routes set fraud v1=100" in str(refused.value)
        assert _state(mesh) == before
        assert all(("fraud", "v3") in _held(mesh, r) for r in _replicas(mesh))

        applier.manager.set_weights("fraud", {"v1": 100, "v2": 0, "v3": 0})
        removed = applier.apply(remove.read_text(), str(remove), prune=True)
        assert removed.plan.removed_models == ["risk"]
        assert sorted(removed.plan.removed_versions) == [("fraud", "v3"), ("risk", "v1")]
        # Envoy no longer routes them; fraud's servers unload what the spec dropped, and
        # risk's pool, with no model left, stops.
        for replica in fraud_servers:
            wait_until(_unloaded(mesh, replica), f"{replica} to unload fraud v3")
        wait_until(
            lambda: not set(added.started) & set(mesh.pids_of("model")), "risk's pool to stop"
        )
        with dial_edge(mesh.spec).channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            with pytest.raises(grpc.RpcError) as gone:
                _pinned(stub, "risk")
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        after_s = load.now_s()
        wait_until(lambda: load.now_s() > after_s + 1.0, "a second of load after the removal")
    finally:
        load.stop()
        # Whatever failed above, the tests after this one start from v1 taking it all
        # (versions left out of the weights get 0, v3 whether it is still there or not).
        applier.manager.set_weights("fraud", {"v1": 100})
    assert not load.error
    outcomes = load.snapshot()
    assert len(outcomes) >= 400
    lost = [o for o in outcomes if o.code != "OK"]
    assert lost == [], (len(lost), len(outcomes), lost[:3])


def test_a_version_missing_from_the_registry_is_refused_and_nothing_loads(
    mesh: Mesh, applier: LiveApply
) -> None:
    text = BASE.replace('v2: {source: "demo:2"}}', 'v2: {source: "demo:2"}, v9: {}}')
    before = _state(mesh)
    with pytest.raises(ApplyError) as refused:
        applier.apply(text, "missing.yaml")
    assert "models.fraud.versions.v9: not in the registry" in str(refused.value)
    assert "servemesh models push" in str(refused.value)
    assert _state(mesh) == before
    for replica in _replicas(mesh):
        assert ("fraud", "v9") not in _held(mesh, replica)


def test_a_bad_artifact_is_refused_with_the_replica_s_reason_and_unloaded_everywhere(
    mesh: Mesh, applier: LiveApply
) -> None:
    text = BASE.replace('v2: {source: "demo:2"}}', 'v2: {source: "demo:2"}, v8: {}}')
    before = _state(mesh)
    with pytest.raises(ApplyError) as refused:
        applier.apply(text, "bad.yaml")
    message = str(refused.value)
    assert message.startswith("model-fraud-zone-"), message
    assert "models.fraud.versions.v8: " in message
    assert "nothing changed" in message
    assert _state(mesh) == before
    for replica in _replicas(mesh):
        assert ("fraud", "v8") not in _held(mesh, replica)
        # The replica keeps serving what it served.
        assert {("fraud", "v1"), ("fraud", "v2")} <= _held(mesh, replica)


def test_unloading_a_version_no_apply_asked_for_is_caught_up_by_the_next_change(
    mesh: Mesh, applier: LiveApply
) -> None:
    """A replica that lost a version the spec lists loads it again when the spec changes."""
    victim = _replicas(mesh)[0]
    with dial_service(mesh.spec, victim).channel() as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        param = oip.ModelRepositoryParameter(string_param="v2")
        stub.RepositoryModelUnload(
            oip.RepositoryModelUnloadRequest(
                model_name="fraud", parameters={LOAD_VERSION_PARAMETER: param}
            ),
            timeout=10,
            metadata=control_metadata_for(mesh.state_dir),
        )
    assert ("fraud", "v2") not in _held(mesh, victim)
    applier.manager.set_weights("fraud", {"v1": 90, "v2": 10})
    try:
        wait_until(lambda: ("fraud", "v2") in _held(mesh, victim), f"{victim} to reload v2")
    finally:
        applier.manager.set_weights("fraud", {"v1": 100, "v2": 0})


def _history_cli(mesh: Mesh, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "servemesh", "routes", "--state-dir", str(mesh.state_dir),
         "history", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_short_file_adds_beside_what_runs_and_every_change_reads_as_a_line(
    mesh: Mesh, applier: LiveApply, tmp_path: Path
) -> None:
    """A file naming only fraud v3 loads it beside fraud's running versions, whose weights
    stay; a tiers, shadow and policy change shows in the plan (dry run and applied) and in
    `routes history` as lines of their own, never as fragments of the spec's JSON."""
    short = _spec_file(tmp_path, "short.yaml", "models:\n  fraud:\n    versions: {v3: {}}\n")
    added = _cli(mesh, str(short))
    assert added.returncode == 0, added.stderr
    assert "+ version" in added.stdout and "fraud v3" in added.stdout
    fraud = applier.manager.live_spec().models["fraud"]
    assert sorted(fraud.versions) == ["v1", "v2", "v3"]
    assert {v: w for v, w in fraud.traffic.items() if w} == {"v1": 100}
    for replica in _replicas(mesh):
        assert ("fraud", "v3") in _held(mesh, replica)

    change = _spec_file(
        tmp_path,
        "change.yaml",
        "models:\n  fraud:\n    tiers: {cache: {ttl: 1m}}\n"
        "    shadow: {version: v3, percent: 50}\n    policy: {timeout_ms: 900}\n",
    )
    # change, what, detail: a row of the plan table each, and a line of the history
    rows = [
        ("~ tiers", "fraud", "off -> cache ttl 1m, 100000 entries"),
        ("~ shadow", "fraud", "off -> v3 (50%)"),
        ("~ policy", "fraud", "traffic.model -> its own"),
    ]
    expected = [f"{change} {what}: {detail}" for change, what, detail in rows]
    before = _state(mesh)
    dry = _cli(mesh, str(change), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert _state(mesh) == before
    applied = _cli(mesh, str(change))
    assert applied.returncode == 0, applied.stderr
    for output in (dry.stdout, applied.stdout):
        for row in rows:
            assert any(all(cell in line for cell in row) for line in output.splitlines()), (
                row,
                output,
            )
    try:
        history = json.loads(_history_cli(mesh, "--json").stdout)
        mine = [e for e in history if str(e["action"]).startswith("apply ")][-2:]
        assert mine[0]["diff"] == ["+ version fraud v3"]
        assert mine[1]["diff"][: len(expected)] == expected
        assert "~ policy fraud timeout_ms: 0 -> 900" in mine[1]["diff"]
        # Every apply's lines read as changes, never as fragments of the spec's JSON
        # (`+  "risk": {`, `+   }`).
        for entry in (e for e in history if str(e["action"]).startswith("apply ")):
            for line in entry["diff"]:
                assert re.match(r"^[+~-] [a-z_ ]+", line) and '"' not in line, entry
        table = _history_cli(mesh)
        assert table.returncode == 0, table.stderr
        assert "+ version fraud v3" in table.stdout and expected[1] in table.stdout
    finally:
        off = "models:\n  fraud:\n    tiers: null\n    shadow: null\n    policy: null\n"
        applier.apply(off, "off.yaml")
