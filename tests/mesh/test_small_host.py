"""The small-host profile on a real two-zone mesh: one feature and one model process (in
the first zone) and one Envoy serve both zones, while each zone keeps its gateway, its mesh
listener and its localities in Envoy: zone-b's clusters list zone-a's replicas as the other
zone's (priority 1), and zone-b's gateway answers through them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.contract.wire import feature_cluster, model_cluster
from servemesh.launcher import Mesh
from servemesh.observe.scrape import sample, scrape
from servemesh.proxy.admin import AdminClient
from servemesh.spec import EDGE_PROXY, DemoSpec, MeshSpec, Ports
from tests.mesh.edge_load import edge_load
from tests.waiting import wait_until

ZONES = ("zone-a", "zone-b")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("small-host")
    spec = MeshSpec(
        profile="small-host",
        ports=Ports.free(),
        state_dir=str(state),
        demo=DemoSpec(enabled=True, entities=50),
    )
    spec = spec.model_copy(
        update={"metrics": spec.metrics.model_copy(update={"prometheus": "off"})}
    )
    with Mesh.from_spec(spec, Path(state)) as running:
        yield running


def test_one_feature_one_model_process_and_one_envoy_serve_both_zones(mesh: Mesh) -> None:
    assert mesh.spec.zones == list(ZONES)
    assert list(mesh.pids_of("feature")) == ["feature-zone-a-0"]
    assert list(mesh.pids_of("model")) == ["model-fraud-zone-a-0"]
    assert sorted(mesh.pids_of("gateway")) == ["gateway-zone-a-0", "gateway-zone-b-0"]
    assert mesh.spec.proxies() == [EDGE_PROXY]
    # Both zones' clusters are in the one Envoy: zone-a's own replica is its priority 0,
    # and the same replica is zone-b's priority 1, the other zone's (the zone topology).
    model = mesh.spec.models["fraud"]
    version = next(v for v, weight in model.traffic.items() if weight)
    address = (
        f"{mesh.spec.host_of('model-fraud-zone-a-0')}:{mesh.spec.port_of('model-fraud-zone-a-0')}"
    )
    admin = AdminClient.of_mesh(mesh.spec.state_dir)

    def placed() -> dict[str, list[tuple[str, str, int, bool]]]:
        clusters = admin.clusters()
        names = {z: model_cluster("fraud", version, z) for z in ZONES}
        names |= {f"feature {z}": feature_cluster(z) for z in ZONES}
        return {
            key: [(h.address, h.zone, h.priority, h.healthy) for h in clusters[name].hosts]
            for key, name in names.items()
        }

    wait_until(
        lambda: all(h[3] for hosts in placed().values() for h in hosts), "every host healthy"
    )
    found = placed()
    assert found["zone-a"] == [(address, "zone-a", 0, True)]
    assert found["zone-b"] == [(address, "zone-a", 1, True)]
    feature = mesh.spec.port_of("feature-zone-a-0")
    assert [(h[1], h[2]) for h in found["feature zone-b"]] == [("zone-a", 1)]
    assert found["feature zone-b"][0][0].endswith(f":{feature}")


def _predicts_answered(mesh: Mesh, gateway: str) -> float:
    samples = scrape(mesh.spec.metrics_address_of(gateway))
    return sample(samples, "servemesh_gateway_predictions_total", {"code": "OK"})


def test_each_zones_gateway_answers_through_the_shared_processes(mesh: Mesh) -> None:
    gateways = [f"gateway-{zone}-0" for zone in ZONES]
    before = {g: _predicts_answered(mesh, g) for g in gateways}
    load = edge_load(mesh)
    load.start()
    try:
        # The edge spreads calls over both zones' gateways; zone-b's has no feature or
        # model process of its own, and answers through zone-a's.
        wait_until(
            lambda: all(_predicts_answered(mesh, g) - before[g] >= 20 for g in gateways),
            "20 answers from each zone's gateway",
            timeout_s=30,
        )
    finally:
        load.stop()
    assert not load.error
    outcomes = load.snapshot()
    failed = [o for o in outcomes if not o.ok]
    assert failed == [], failed[:3]
    assert {o.replica for o in outcomes} == {"model-fraud-zone-a-0"}
