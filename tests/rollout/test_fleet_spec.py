"""The running spec's fleet without a mesh: names, ports, validation, and what Envoy is told."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servemesh.contract.wire import model_cluster, model_servers_cluster
from servemesh.identity.enroll import mesh_identities
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.render import render_proxies
from servemesh.rollout.fleet import StrategyContext, _rolled_before
from servemesh.spec import (
    FleetState,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    ReplicaSet,
    ResolvedSpec,
    declared,
    dump_spec,
    parse_resolved,
    parse_spec_or_resolved,
    resolve,
)
from servemesh.spec.rollout_plan import RolloutPlan
from servemesh.state.paths import MeshPaths

GREEN = ReplicaSet(name="green", serves={"fraud": ["v2"]})


def running(tmp_path: Path, services_base: int = 0) -> ResolvedSpec:
    spec = MeshSpec(
        ports=Ports(edge=0, mesh=0, envoy_admin=0, services_base=services_base),
        state_dir=str(tmp_path),
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="demo:2"),
                },
                traffic={"v1": 100, "v2": 0},
            )
        },
    )
    return resolve(spec)


def with_fleet(live: ResolvedSpec, **fleet: Any) -> ResolvedSpec:
    return resolve(live.model_copy(update={"fleet": FleetState(**fleet)}))


def models(spec: ResolvedSpec) -> list[str]:
    return [i.name for i in spec.instances() if i.service == "model"]


def every_cluster(spec: ResolvedSpec, tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Every cluster the mesh's Envoys hold (the edge's, and each zone's own), by name."""
    return {c["name"]: c for part in render_proxies(spec, tmp_path).values() for c in part.clusters}


def endpoints(spec: ResolvedSpec, cluster: str, tmp_path: Path) -> list[dict[str, Any]]:
    assignments = {
        name: assignment
        for part in render_proxies(spec, tmp_path).values()
        for name, assignment in part.load_assignments.items()
    }
    assignment = assignments[cluster]
    return [e for locality in assignment["endpoints"] for e in locality["lb_endpoints"]]


def port_of(endpoint: dict[str, Any]) -> int:
    return int(endpoint["endpoint"]["address"]["socket_address"]["port_value"])


def test_a_second_set_gets_names_and_ports_of_its_own_and_keeps_every_other_port(
    tmp_path: Path,
) -> None:
    live = running(tmp_path)
    both = with_fleet(live, sets=[ReplicaSet(), GREEN])
    assert models(live) == ["model-fraud-zone-a-0", "model-fraud-zone-b-0"]
    assert models(both) == [
        "model-fraud-zone-a-0",
        "model-fraud-zone-b-0",
        "model-fraud-green-zone-a-0",
        "model-fraud-green-zone-b-0",
    ]
    for name, port in live.instance_ports.items():
        assert both.instance_ports[name] == port
        assert both.metrics_ports[name] == live.metrics_ports[name]
    held = {*live.instance_ports.values(), *live.metrics_ports.values()}
    fresh = [both.port_of(n) for n in models(both)[2:]]
    fresh += [both.metrics_ports[n] for n in models(both)[2:]]
    assert len(set(fresh)) == 4 and not set(fresh) & held
    # Each new replica gets a certificate of its own when the mesh issues them.
    assert {"model-fraud-green-zone-a-0", "model-fraud-green-zone-b-0"} <= set(
        mesh_identities(both)
    )


def test_fixed_service_ports_stay_with_their_instances_when_a_set_joins(tmp_path: Path) -> None:
    live = running(tmp_path, services_base=52000)
    both = with_fleet(live, sets=[ReplicaSet(), GREEN])
    assert {n: both.instance_ports[n] for n in live.instance_ports} == live.instance_ports
    assert len(set(both.instance_ports.values())) == len(both.instance_ports)


def test_retiring_the_first_set_drops_its_ports_and_keeps_the_green_ones(tmp_path: Path) -> None:
    both = with_fleet(running(tmp_path), sets=[ReplicaSet(), GREEN])
    only = with_fleet(both, sets=[ReplicaSet(name="green")])
    assert models(only) == ["model-fraud-green-zone-a-0", "model-fraud-green-zone-b-0"]
    assert "model-fraud-zone-a-0" not in only.instance_ports
    assert only.port_of("model-fraud-green-zone-a-0") == both.port_of("model-fraud-green-zone-a-0")


def test_the_fleet_survives_the_resolved_file_and_is_no_part_of_a_declared_spec(
    tmp_path: Path,
) -> None:
    both = with_fleet(
        running(tmp_path), sets=[ReplicaSet(), GREEN], draining=["model-fraud-zone-a-0"]
    )
    text = dump_spec(both)
    assert parse_resolved(text).fleet == both.fleet
    assert isinstance(parse_spec_or_resolved(text), ResolvedSpec)
    assert "fleet" not in declared(both).model_dump()


@pytest.mark.parametrize(
    ("fleet", "message"),
    [
        ({"draining": ["model-fraud-zone-c-0"]}, "fleet.draining: names no replica"),
        ({"generations": {"gateway-zone-a-0": 1}}, "fleet.generations: names no model server"),
        (
            {"sets": [ReplicaSet(), ReplicaSet(name="green", serves={"fraud": ["v9"]})]},
            r"fleet.sets\[1\].serves.fraud: no such versions \['v9'\]",
        ),
        (
            {"sets": [ReplicaSet(), ReplicaSet(name="green", serves={"risk": ["v1"]})]},
            r"fleet.sets\[1\].serves.risk: no such model",
        ),
    ],
)
def test_a_fleet_naming_what_does_not_run_is_refused_naming_the_field(
    tmp_path: Path, fleet: dict[str, Any], message: str
) -> None:
    live = running(tmp_path)
    proposed = live.model_copy(update={"fleet": FleetState.model_validate(fleet)})
    with pytest.raises(ValueError, match=message):
        resolve(proposed)


def test_set_names_must_differ_and_be_plain() -> None:
    with pytest.raises(ValueError, match="sets: two sets named 'green' share pools"):
        FleetState(sets=[ReplicaSet(name="green"), ReplicaSet(name="green")])
    with pytest.raises(ValueError, match="sets: two sets named 'green' share pools"):
        FleetState(
            sets=[
                ReplicaSet(),
                ReplicaSet(name="green", pools=["fraud", "risk"]),
                ReplicaSet(name="green", pools=["risk"]),
            ]
        )
    # Sets of different pools may share a name: their replicas' names differ by pool.
    FleetState(
        sets=[
            ReplicaSet(),
            ReplicaSet(name="green", pools=["fraud"]),
            ReplicaSet(name="green", pools=["risk"]),
        ]
    )
    with pytest.raises(ValueError, match="the first set spans every pool"):
        FleetState(sets=[ReplicaSet(pools=["fraud"])])
    with pytest.raises(ValueError, match="name"):
        ReplicaSet(name="Green-1")


def test_a_version_s_clusters_list_the_set_that_serves_it(tmp_path: Path) -> None:
    both = with_fleet(running(tmp_path), sets=[ReplicaSet(), GREEN])
    green = {both.port_of("model-fraud-green-zone-a-0"), both.port_of("model-fraud-green-zone-b-0")}
    blue = {both.port_of("model-fraud-zone-a-0"), both.port_of("model-fraud-zone-b-0")}
    for zone in both.zones:
        assert {
            port_of(e) for e in endpoints(both, model_cluster("fraud", "v2", zone), tmp_path)
        } == green
        assert {
            port_of(e) for e in endpoints(both, model_cluster("fraud", "v1", zone), tmp_path)
        } == blue
        assert {port_of(e) for e in endpoints(both, model_servers_cluster(zone), tmp_path)} == blue
    clusters = every_cluster(both, tmp_path)
    # A host the endpoints stop listing leaves at once (the scaler's drained gateways and
    # feature services too), but not on the registry's cluster.
    assert clusters[model_cluster("fraud", "v2", "zone-a")]["ignore_health_on_host_removal"]
    assert clusters["gateway"]["ignore_health_on_host_removal"]
    assert "ignore_health_on_host_removal" not in clusters["registry"]


def test_a_draining_replica_is_listed_as_draining_in_every_cluster(tmp_path: Path) -> None:
    spec = with_fleet(running(tmp_path), draining=["model-fraud-zone-a-0"])
    port = spec.port_of("model-fraud-zone-a-0")
    for cluster in (model_cluster("fraud", "v1", "zone-b"), model_servers_cluster("zone-a")):
        listed = {port_of(e): e.get("health_status") for e in endpoints(spec, cluster, tmp_path)}
        assert listed == {port: "DRAINING", spec.port_of("model-fraud-zone-b-0"): None}


@pytest.mark.parametrize(
    ("marker", "skipped"),
    [
        (None, []),
        ("rolling:draining:model-fraud-zone-b-0", ["model-fraud-zone-a-0"]),
        ("rolling:renewing:model-fraud-zone-b-0", ["model-fraud-zone-a-0"]),
        ("rolling:replaced:model-fraud-zone-a-0", ["model-fraud-zone-a-0"]),
        ("rolling:replaced:model-fraud-zone-b-0", ["model-fraud-zone-a-0", "model-fraud-zone-b-0"]),
        ("rolling:switched", ["model-fraud-zone-a-0", "model-fraud-zone-b-0"]),
    ],
)
def test_a_resumed_rolling_update_skips_the_replicas_it_replaced(
    tmp_path: Path, marker: str | None, skipped: list[str]
) -> None:
    live = running(tmp_path)
    ctx = StrategyContext(
        manager=RouteManager(MeshPaths(tmp_path)),
        spec=live,
        model="fraud",
        version="v2",
        baseline="v1",
        plan=RolloutPlan(),
        resume_from=marker,
    )
    assert sorted(_rolled_before(ctx, models(live))) == skipped


def two_pools(tmp_path: Path) -> ResolvedSpec:
    """fraud and risk, each on a pool of its own (the default), two zones."""
    live = running(tmp_path)
    risk = ModelSpec(
        versions={"v1": ModelVersionSpec(source="demo:3"), "v2": ModelVersionSpec(source="demo:4")},
        traffic={"v1": 100, "v2": 0},
    )
    return resolve(live.model_copy(update={"models": {**live.models, "risk": risk}}))


FRAUD_GREEN = ReplicaSet(name="green", serves={"fraud": ["v2"]}, pools=["fraud"])


def test_a_blue_green_set_starts_replicas_in_its_own_pool_only(tmp_path: Path) -> None:
    live = two_pools(tmp_path)
    both = with_fleet(live, sets=[ReplicaSet(), FRAUD_GREEN])
    added = sorted(set(models(both)) - set(models(live)))
    assert added == ["model-fraud-green-zone-a-0", "model-fraud-green-zone-b-0"]
    assert {n: both.instance_ports[n] for n in live.instance_ports} == live.instance_ports
    # risk's clusters are what they were; fraud v2's list the green replicas.
    risk = {both.port_of(f"model-risk-zone-{z}-0") for z in "ab"}
    green = {both.port_of(n) for n in added}
    for zone in both.zones:
        for version in ("v1", "v2"):
            listed = endpoints(both, model_cluster("risk", version, zone), tmp_path)
            assert {port_of(e) for e in listed} == risk
        listed = endpoints(both, model_cluster("fraud", "v2", zone), tmp_path)
        assert {port_of(e) for e in listed} == green
    assert [i.name for i in both.first_set_replicas()] == models(live)


def test_retiring_a_pool_s_old_set_renames_that_pool_s_replicas_only(tmp_path: Path) -> None:
    both = with_fleet(two_pools(tmp_path), sets=[ReplicaSet(), FRAUD_GREEN])
    retired = with_fleet(both, sets=[ReplicaSet()], homes={"fraud": "green"})
    assert models(retired) == [
        "model-fraud-green-zone-a-0",
        "model-fraud-green-zone-b-0",
        "model-risk-zone-a-0",
        "model-risk-zone-b-0",
    ]
    for name in models(retired):
        assert retired.port_of(name) == both.port_of(name)
    assert retired.version_replicas("fraud", "v1")[0].replica_set == "green"
    assert retired.version_replicas("risk", "v1")[0].replica_set == ""
    # The next blue-green of fraud takes the other name; risk's may take "green".
    assert with_fleet(
        retired,
        sets=[ReplicaSet(), ReplicaSet(name="blue", serves={"fraud": ["v1"]}, pools=["fraud"])],
        homes={"fraud": "green"},
    ).set_replicas("blue", "fraud")
    risk_green = ReplicaSet(name="green", serves={"risk": ["v2"]}, pools=["risk"])
    assert [
        i.name
        for i in with_fleet(
            retired, sets=[ReplicaSet(), risk_green], homes={"fraud": "green"}
        ).set_replicas("green", "risk")
    ] == ["model-risk-green-zone-a-0", "model-risk-green-zone-b-0"]


@pytest.mark.parametrize(
    ("fleet", "message"),
    [
        (
            {"sets": [ReplicaSet(), ReplicaSet(name="green", pools=["nope"])]},
            r"fleet.sets\[1\].pools: no such pools \['nope'\]",
        ),
        (
            {
                "sets": [
                    ReplicaSet(),
                    ReplicaSet(name="green", serves={"risk": ["v2"]}, pools=["fraud"]),
                ]
            },
            r"fleet.sets\[1\].serves.risk: the model's pool 'risk' is not one of",
        ),
        ({"homes": {"nope": "green"}}, r"fleet.homes: no such pools \['nope'\]"),
        (
            {"sets": [ReplicaSet(), FRAUD_GREEN], "homes": {"fraud": "green"}},
            "instance names collide",
        ),
    ],
)
def test_a_per_pool_fleet_naming_what_does_not_run_is_refused(
    tmp_path: Path, fleet: dict[str, Any], message: str
) -> None:
    live = two_pools(tmp_path)
    with pytest.raises(ValueError, match=message):
        resolve(live.model_copy(update={"fleet": FleetState.model_validate(fleet)}))
