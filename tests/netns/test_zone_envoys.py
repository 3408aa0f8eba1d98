"""An Envoy per zone with the zones in network namespaces (root, iproute2, iptables): each
zone's Envoy runs inside its zone's namespace, the edge's on the machine; a zone's Envoy
reaches the other zone's replicas across the zones' bridge (their health checks pass), a
partition cuts exactly that (each zone then serves from its own replicas, no call lost),
and the heal brings it back. Skipped, with the reason, where this machine cannot."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.contract.wire import model_cluster
from servemesh.launcher import Mesh, envoy_child
from servemesh.procs.netns import NETNS_DIR
from servemesh.proxy.admin import AdminClient, admin_socket_path
from servemesh.spec import EDGE_PROXY, DemoSpec, MeshSpec, NetworkSpec, Ports, ProxySpec
from tests.mesh.edge_load import edge_load, zones_answering
from tests.netns.helpers import needs_netns
from tests.waiting import wait_until

pytestmark = needs_netns

ZONES = ("zone-a", "zone-b")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("zone-envoys-netns")
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(state),
        network=NetworkSpec(mode="netns"),
        proxy=ProxySpec(layout="per_zone"),
        demo=DemoSpec(enabled=True, entities=50),
    )
    spec = spec.model_copy(
        update={"metrics": spec.metrics.model_copy(update={"prometheus": "off"})}
    )
    with Mesh.from_spec(spec, Path(state)) as running:
        yield running


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _zone_b_models_seen_from_zone_a(mesh: Mesh) -> int:
    admin = AdminClient(admin_socket_path(mesh.state_dir, "zone-a"))
    version = sorted(mesh.spec.models["fraud"].versions)[0]
    view = admin.clusters()[model_cluster("fraud", version, "zone-a")]
    return view.healthy_by_zone().get("zone-b", 0)


def test_each_zone_envoy_runs_inside_its_zone_and_the_edges_on_the_machine(mesh: Mesh) -> None:
    network = mesh.network
    assert network is not None
    for zone in ZONES:
        inside = os.stat(NETNS_DIR / network.namespace(zone)).st_ino
        assert _netns_inode(mesh.pid(envoy_child(zone))) == inside, zone
    assert _netns_inode(mesh.pid(envoy_child(EDGE_PROXY))) == _netns_inode(os.getpid())


def test_a_partition_cuts_a_zone_envoy_off_the_other_zone_and_the_heal_joins_them(
    mesh: Mesh,
) -> None:
    network = mesh.network
    assert network is not None
    # Zone-a's Envoy, inside zone-a, health-checks zone-b's replicas across the bridge.
    wait_until(lambda: _zone_b_models_seen_from_zone_a(mesh) >= 1, "zone-b healthy from zone-a")
    load = edge_load(mesh)
    load.start()
    try:
        wait_until(
            lambda: zones_answering(load) >= set(ZONES),
            "both zones answering",
        )
        network.partition("zone-a", "zone-b")
        try:
            wait_until(
                lambda: _zone_b_models_seen_from_zone_a(mesh) == 0,
                "zone-a's Envoy to lose zone-b's replicas",
                timeout_s=30,
            )
            cut = load.now_s()
            wait_until(
                lambda: zones_answering(load, cut) >= set(ZONES),
                "both zones answering from their own replicas while cut off",
            )
        finally:
            network.heal()
        wait_until(
            lambda: _zone_b_models_seen_from_zone_a(mesh) >= 1,
            "zone-b healthy from zone-a again after the heal",
            timeout_s=30,
        )
    finally:
        load.stop()
    assert not load.error
    outcomes = load.snapshot()
    failed = [o for o in outcomes if not o.ok or o.degraded]
    # Each zone's gateway, Envoy and replicas sit inside one namespace: a cut between the
    # zones costs no call (the steady state the partition drill holds to).
    assert len(failed) <= 0.005 * len(outcomes), failed[:3]
