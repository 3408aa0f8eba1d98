"""Catalog to Envoy endpoints, and what a service sends Consul: pure functions, no network."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from servemesh.catalog.consul_catalog import entries_of, service_id, service_registration
from servemesh.catalog.file import CatalogEntry, FileCatalog
from servemesh.contract.wire import (
    GATEWAY_CLUSTER,
    feature_cluster,
    model_cluster,
    model_servers_cluster,
)
from servemesh.discovery.endpoints import endpoint_files
from servemesh.proxy.render import render_resources
from servemesh.spec import MeshSpec, ResolvedSpec, SpecError, parse_spec, resolve
from servemesh.state.paths import XdsLayout

LAYOUT = XdsLayout(Path("/state/xds"))


def _spec(**overrides: object) -> ResolvedSpec:
    """The shared layout: one Envoy, every cluster's endpoint file under LAYOUT (the control
    plane's per-Envoy folders: tests/discovery/test_control_plane.py)."""
    declared = {"ports": {"edge": 0, "mesh": 0}, "proxy": {"layout": "shared"}, **overrides}
    return resolve(MeshSpec.model_validate(declared))


def _hosts(files: dict[Path, dict[str, Any]], cluster: str) -> list[tuple[str, int, str]]:
    """(address:port, priority, zone) of every endpoint in a cluster's file."""
    content = files[LAYOUT.eds(cluster)]
    [assignment] = content["resources"]
    found = []
    for locality in assignment["endpoints"]:
        for lb in locality["lb_endpoints"]:
            sock = lb["endpoint"]["address"]["socket_address"]
            found.append(
                (f"{sock['address']}:{sock['port_value']}", locality.get("priority", 0),
                 locality.get("locality", {}).get("zone", ""))
            )  # fmt: skip
    return sorted(found)


def _entries() -> list[CatalogEntry]:
    return [
        CatalogEntry("model", "model-fraud-zone-a-0", "zone-a", "10.0.0.5", 50052),
        CatalogEntry("model", "model-fraud-zone-b-0", "zone-b", "10.0.1.5", 50053),
        CatalogEntry("model", "model-fraud-zone-b-1", "zone-b", "10.0.1.6", 50053, passing=False),
        CatalogEntry("feature", "feature-zone-a-0", "zone-a", "10.0.0.7", 50054),
    ]


def test_the_caller_s_zone_is_priority_0_and_the_other_zone_priority_1() -> None:
    files = endpoint_files(render_resources(_spec(), Path("/logs")), LAYOUT, _entries())
    assert _hosts(files, model_servers_cluster("zone-a")) == [
        ("10.0.0.5:50052", 0, "zone-a"),
        ("10.0.1.5:50053", 1, "zone-b"),
    ]
    assert _hosts(files, model_cluster("fraud", "v2", "zone-b")) == [
        ("10.0.0.5:50052", 1, "zone-a"),
        ("10.0.1.5:50053", 0, "zone-b"),
    ]
    assert _hosts(files, feature_cluster("zone-b")) == [("10.0.0.7:50054", 1, "zone-a")]


def test_only_passing_instances_become_endpoints() -> None:
    resources = render_resources(_spec(), Path("/logs"))
    files = endpoint_files(resources, LAYOUT, _entries())
    every = [h for name in resources.endpoint_sets for h in _hosts(files, name)]
    assert every
    assert "10.0.1.6:50053" not in {address for address, _, _ in every}


def test_a_kind_without_instances_gets_an_empty_endpoint_file_not_a_missing_one() -> None:
    resources = render_resources(_spec(), Path("/logs"))
    files = endpoint_files(resources, LAYOUT, [])
    assert {p.stem for p in files} >= set(resources.endpoint_sets)
    assert _hosts(files, GATEWAY_CLUSTER) == []


def test_the_version_follows_each_file_s_endpoints_only() -> None:
    resources = render_resources(_spec(), Path("/logs"))
    before = endpoint_files(resources, LAYOUT, _entries())
    moved = [*_entries(), CatalogEntry("feature", "feature-zone-b-0", "zone-b", "10.0.1.7", 1)]
    after = endpoint_files(resources, LAYOUT, moved)
    changed = {p.stem for p in before if before[p]["version_info"] != after[p]["version_info"]}
    assert changed == {feature_cluster("zone-a"), feature_cluster("zone-b")}
    assert endpoint_files(resources, LAYOUT, list(reversed(_entries()))) == before


def test_the_file_catalog_is_the_spec_s_instances_at_their_ports() -> None:
    spec = _spec()
    entries = FileCatalog(spec).entries("model")
    assert sorted((e.instance, e.zone, e.address, e.port) for e in entries) == [
        ("model-fraud-zone-a-0", "zone-a", "127.0.0.1", spec.port_of("model-fraud-zone-a-0")),
        ("model-fraud-zone-b-0", "zone-b", "127.0.0.1", spec.port_of("model-fraud-zone-b-0")),
    ]
    # The same endpoints the renderer gives Envoy without any catalog.
    resources = render_resources(spec, Path("/logs"))
    every = [e for kind in ("registry", "model", "feature", "gateway")
             for e in FileCatalog(spec).entries(kind)]  # fmt: skip
    files = endpoint_files(resources, LAYOUT, every)
    for name, assignment in resources.load_assignments.items():
        assert files[LAYOUT.eds(name)]["resources"][0]["endpoints"] == assignment["endpoints"]


def test_registration_names_kind_instance_zone_versions_and_a_mutual_tls_check() -> None:
    spec = _spec(discovery={"backend": "consul", "deregister_after": "30s"})
    payload = service_registration(spec, "model-fraud-zone-b-0", "10.0.1.5")
    assert payload["name"] == "model"
    assert payload["service_id"] == "servemesh-model-fraud-zone-b-0"
    assert (payload["address"], payload["port"]) == (
        "10.0.1.5",
        spec.port_of("model-fraud-zone-b-0"),
    )
    assert payload["meta"] == {
        "mesh": "servemesh",
        "instance": "model-fraud-zone-b-0",
        "zone": "zone-b",
        "versions": "fraud:v1,fraud:v2",
    }
    check = payload["check"]
    assert check["grpc"] == f"10.0.1.5:{spec.port_of('model-fraud-zone-b-0')}"
    assert check["grpc_use_tls"] is True and check["tls_skip_verify"] is False
    assert check["TLSServerName"] == "model-fraud-zone-b-0.servemesh.internal"
    assert check["DeregisterCriticalServiceAfter"] == "30s"
    assert check["interval"] == "2000ms"
    # Only model servers list versions.
    assert "versions" not in service_registration(spec, "gateway-zone-a-0", "10.0.0.9")["meta"]


def test_a_consul_answer_becomes_entries_of_this_mesh_only_with_health() -> None:
    spec = _spec()

    def node(instance: str, mesh: str, statuses: list[str]) -> dict[str, object]:
        return {
            "Node": {"Address": "10.9.9.9"},
            "Service": {
                "ID": f"{mesh}-{instance}",
                "Address": "10.0.0.5",
                "Port": 50052,
                "Meta": {"mesh": mesh, "instance": instance, "zone": "zone-a"},
            },
            "Checks": [{"Status": s} for s in statuses],
        }

    answer = [
        node("model-fraud-zone-a-0", "servemesh", ["passing", "passing"]),
        node("model-fraud-zone-a-1", "servemesh", ["passing", "critical"]),
        node("model-fraud-zone-a-0", "other-mesh", ["passing"]),
    ]
    assert entries_of(spec, "model", answer) == [
        CatalogEntry("model", "model-fraud-zone-a-0", "zone-a", "10.0.0.5", 50052, passing=True),
        CatalogEntry("model", "model-fraud-zone-a-1", "zone-a", "10.0.0.5", 50052, passing=False),
    ]
    assert service_id(spec, "model-fraud-zone-a-0") == "servemesh-model-fraud-zone-a-0"


def test_hosts_place_parts_and_listen_host_is_what_binds() -> None:
    spec = _spec(
        discovery={"listen_host": "0.0.0.0", "hosts": {"envoy": "envoy", "registry-0": "reg"}}
    )
    assert spec.registry_address == f"reg:{spec.port_of('registry-0')}"
    assert spec.mesh_address_for("zone-b") == f"envoy:{spec.mesh_ports['zone-b']}"
    assert spec.edge_address.startswith("envoy:")
    assert spec.address_of("model-fraud-zone-a-0").startswith("127.0.0.1:")
    resources = render_resources(spec, Path("/logs"))
    assert {ls["address"]["socket_address"]["address"] for ls in resources.listeners} == {"0.0.0.0"}


def test_hosts_naming_an_unknown_part_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"discovery\.hosts: names no instance.*'nobody'"):
        parse_spec(yaml.safe_dump({"discovery": {"hosts": {"nobody": "x"}}}))
