"""A mesh started as root with its zones in network namespaces, and its state dir where
other users may pass: each model server runs inside its zone's namespace as the sandbox's
user, without any capability, and the mesh predicts through both zones.

Inside a namespace every process passes through `ip netns exec` (root) and a setpriv that
drops the capabilities; the sandbox's change of user has to happen in that same setpriv
(servemesh.procs.netns.drop_privileges_argv). Skipped, with the reason, where this machine
cannot run zones in namespaces or start processes as another user."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.procs.netns import NETNS_DIR
from servemesh.procs.sandbox import AUTO_GID, AUTO_UID, RunAs, pool_users
from servemesh.spec import NetworkSpec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import test_mesh_spec
from tests.mesh.edge_load import edge_load, zones_answering
from tests.netns.helpers import capabilities, needs_netns
from tests.waiting import wait_until

pytestmark = [
    needs_netns,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("setpriv") is None,
        reason="model servers run as another user only when the mesh runs as root (setpriv)",
    ),
]

ZONES = ("zone-a", "zone-b")


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    # pytest's tmp dirs are 0700, which would leave model servers as root (and the mesh
    # would say so): the state dir sits under a folder others may pass, not list.
    parent = Path(tempfile.mkdtemp(prefix="servemesh-netns-sandbox-"))
    os.chmod(parent, 0o711)
    try:
        spec = test_mesh_spec(str(parent / "state"), entities=50)
        spec = spec.model_copy(
            update={
                "network": NetworkSpec(mode="netns"),
                "metrics": spec.metrics.model_copy(update={"prometheus": "off"}),
            }
        )
        with Mesh.from_spec(spec) as running:
            yield running
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_each_model_server_runs_in_its_zone_as_the_sandbox_user_without_capabilities(
    mesh: Mesh,
) -> None:
    network = mesh.network
    assert network is not None
    servers = mesh.pids_of("model")
    assert {mesh.spec.instance(name).zone for name in servers} == set(ZONES)
    users = pool_users(RunAs(AUTO_UID, AUTO_GID), mesh.spec.pool_names())
    for name, pid in servers.items():
        user = users[mesh.spec.instance(name).pool]  # its pool's own user
        inside = os.stat(NETNS_DIR / network.namespace(mesh.spec.instance(name).zone)).st_ino
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == inside, name
        caps = capabilities(pid)
        assert (caps["Uid"], caps["CapEff"], caps["CapBnd"], caps["NoNewPrivs"]) == (
            str(user.uid),
            "0000000000000000",
            "0000000000000000",
            "1",
        ), name
        gid_line = Path(f"/proc/{pid}/status").read_text().split("\nGid:\t", 1)[1]
        assert gid_line.split()[:4] == [str(user.gid)] * 4, name
    # The rest of the zone's processes stay the launcher's user, without capabilities.
    for pid in mesh.pids_of("feature").values():
        assert capabilities(pid)["Uid"] == "0"
        assert capabilities(pid)["CapEff"] == "0000000000000000"


def test_the_sandboxed_mesh_predicts_through_both_zones(mesh: Mesh) -> None:
    with dial_edge(mesh.spec).channel() as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1", "user-2"]),
            timeout=30,
        )
    assert len(reply.scores) == 2
    load = edge_load(mesh)
    load.start()
    try:
        wait_until(lambda: zones_answering(load) >= set(ZONES), "both zones answering")
    finally:
        load.stop()
    assert not load.error
    failed = [o for o in load.snapshot() if not o.ok or o.degraded]
    assert failed == []
