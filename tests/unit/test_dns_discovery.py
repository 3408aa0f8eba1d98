"""`discovery.backend: dns`: the spec's keys and refusals, the STRICT_DNS clusters Envoy
validates (static and dynamic bootstraps), no endpoint file, and what refuses a DNS mesh."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from servemesh.contract.wire import (
    ENVOY_ADMIN_CLUSTER,
    GATEWAY_CLUSTER,
    REGISTRY_CLUSTER,
    feature_cluster,
    model_cluster,
    model_servers_cluster,
)
from servemesh.discovery.control_plane import NoCatalog, catalog_for
from servemesh.identity import issue_mesh_certificates
from servemesh.proxy.offline import validate_offline
from servemesh.proxy.process import validate_config
from servemesh.proxy.render import (
    dynamic_bootstrap,
    render_proxies,
    render_resources,
    static_bootstrap,
    xds_files,
)
from servemesh.proxy.replicas import _hosts_of
from servemesh.rollout.fleet import FleetError, _supported
from servemesh.scaling.actuator import busy_with_an_update
from servemesh.spec import MeshSpec, ResolvedSpec, SpecError, parse_spec, resolve
from servemesh.state.paths import XdsLayout

_DNS = "type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster"
_PORTS = {"edge": 0, "mesh": 0, "envoy_admin": 0, "services_base": 0}


def _spec(layout: str = "shared", **discovery: Any) -> ResolvedSpec:
    declared = {
        "ports": _PORTS,
        "proxy": {"layout": layout},
        "discovery": {"backend": "dns", **discovery},
    }
    return resolve(MeshSpec.model_validate(declared))


def _cluster(spec: ResolvedSpec, name: str) -> dict[str, Any]:
    resources = render_resources(spec, Path("/tmp"))
    return next(c for c in resources.clusters if c["name"] == name)


def _hosts(cluster: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(name, port, priority) of every endpoint a cluster lists."""
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
            locality["priority"],
        )
        for locality in cluster["load_assignment"]["endpoints"]
        for e in locality["lb_endpoints"]
    ]


def test_every_service_cluster_is_strict_dns_with_the_spec_s_settings() -> None:
    spec = _spec(dns_refresh_rate_ms=1500, respect_dns_ttl=True, dns_lookup_family="all")
    resources = render_resources(spec, Path("/tmp"))
    service_clusters = set(resources.endpoint_sets)
    assert {GATEWAY_CLUSTER, REGISTRY_CLUSTER, model_cluster("fraud", "v1", "zone-a")} <= (
        service_clusters
    )
    for cluster in resources.clusters:
        assert "eds_cluster_config" not in cluster
        assert cluster["load_assignment"]["cluster_name"] == cluster["name"]
        if cluster["name"] not in service_clusters:
            assert cluster["type"] == "STATIC"  # the admin socket, the collector
            continue
        assert "type" not in cluster
        dns = cluster["cluster_type"]["typed_config"]
        assert dns == {
            "@type": _DNS,
            "dns_refresh_rate": "1.500s",
            "respect_dns_ttl": True,
            "dns_lookup_family": "ALL",
            "all_addresses_in_single_endpoint": False,
        }


def test_health_checks_breakers_outlier_detection_and_tls_are_those_of_the_file_catalog() -> None:
    dns, file = _spec(), _spec().model_copy(update={"discovery": MeshSpec().discovery})
    name = model_cluster("fraud", "v1", "zone-a")
    by_dns, by_file = _cluster(dns, name), _cluster(file, name)
    left_out = {"type", "cluster_type", "load_assignment"}
    assert {k: v for k, v in by_dns.items() if k not in left_out} == {
        k: v for k, v in by_file.items() if k not in left_out
    }
    for key in ("health_checks", "outlier_detection", "circuit_breakers", "transport_socket"):
        assert by_dns[key]


def test_by_default_each_instance_is_its_host_and_own_port_the_caller_s_zone_first() -> None:
    spec = _spec()
    hosts = _hosts(_cluster(spec, model_servers_cluster("zone-b")))
    expected = {
        (spec.host, spec.port_of(i.name), 0 if i.zone == "zone-b" else 1)
        for i in spec.instances()
        if i.service == "model"
    }
    assert set(hosts) == expected and len(hosts) == len(expected)


def test_a_pattern_names_a_kind_s_group_and_one_port_makes_it_one_host_per_zone() -> None:
    names = {"model": "model-{zone}.svc", "gateway": "tasks.gateway"}
    spec = _spec(dns_names=names, dns_port=50051)
    assert _hosts(_cluster(spec, model_servers_cluster("zone-a"))) == [
        ("model-zone-a.svc", 50051, 0),
        ("model-zone-b.svc", 50051, 1),
    ]
    # One name for every zone's gateways: one endpoint (listed twice, Envoy would hold each
    # address twice), in the zone of the first.
    assert _hosts(_cluster(spec, GATEWAY_CLUSTER)) == [("tasks.gateway", 50051, 0)]
    feature = _hosts(_cluster(spec, feature_cluster("zone-a")))
    assert {h for h, _, _ in feature} == {spec.host}  # kinds not named keep {host}


def test_a_pool_s_pattern_wins_over_its_kind_s() -> None:
    declared = {
        "ports": _PORTS,
        "proxy": {"layout": "shared"},
        "models": {"fraud": {}, "big": {"pool": "gpu"}},
        "discovery": {
            "backend": "dns",
            "dns_names": {"model": "{instance}.cpu", "gpu": "{pool}-{zone}"},
        },
    }
    spec = resolve(MeshSpec.model_validate(declared))
    big = {h for h, _, _ in _hosts(_cluster(spec, model_cluster("big", "v1", "zone-a")))}
    fraud = {h for h, _, _ in _hosts(_cluster(spec, model_cluster("fraud", "v1", "zone-a")))}
    assert big == {"gpu-zone-a", "gpu-zone-b"}
    assert fraud and all(h.endswith(".cpu") and h.startswith("model-") for h in fraud)


@pytest.mark.parametrize("layout", ["shared", "per_zone"])
def test_envoy_validates_the_dns_clusters_of_every_envoy(layout: str, tmp_path: Path) -> None:
    spec = _spec(layout, dns_names={"model": "model-{zone}", "feature": "tasks.feature-{zone}"})
    validate_offline(spec, tmp_path)


def test_the_watched_files_hold_no_endpoint_file_and_envoy_takes_them(tmp_path: Path) -> None:
    spec = _spec(dns_names={"gateway": "localhost"}).model_copy(
        update={"state_dir": str(tmp_path / "state")}
    )
    issue_mesh_certificates(spec)
    resources = render_resources(spec, tmp_path)
    layout = XdsLayout(tmp_path / "xds")
    files = xds_files(resources, layout, "3")
    assert not [p for p in files if p.parent.name == "eds"]
    for path, content in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(content))
    config = tmp_path / "envoy.yaml"
    config.write_text(yaml.safe_dump(dynamic_bootstrap(spec, resources, layout, tmp_path)))
    validate_config(config)
    cds = {c["name"]: c for c in yaml.safe_load(layout.cds.read_text())["resources"]}
    assert cds[GATEWAY_CLUSTER]["cluster_type"]["name"] == "envoy.cluster.dns"
    assert cds[ENVOY_ADMIN_CLUSTER]["type"] == "STATIC"
    static = static_bootstrap(spec, resources, tmp_path)["static_resources"]["clusters"]
    assert next(c for c in static if c["name"] == GATEWAY_CLUSTER)["cluster_type"]


def test_the_per_zone_layout_splits_dns_clusters_as_it_splits_eds_ones() -> None:
    spec = _spec("per_zone")
    proxies = render_proxies(spec, Path("/tmp"))
    zone_a = {c["name"] for c in proxies["zone-a"].clusters}
    assert model_servers_cluster("zone-a") in zone_a and GATEWAY_CLUSTER not in zone_a
    for resources in proxies.values():
        assert all("load_assignment" in c for c in resources.clusters)


@pytest.mark.parametrize(
    ("discovery", "field"),
    [
        ({"dns_names": {"model": "model-{replica}"}}, "discovery.dns_names.model"),
        ({"dns_names": {"model": "model_{zone}"}}, "discovery.dns_names.model"),
        ({"dns_names": {"models": "m"}}, "discovery.dns_names"),
        ({"dns_names": {"model": "-{zone}"}}, "discovery.dns_names.model"),
        ({"dns_port": 0}, "discovery.dns_port"),
        ({"dns_refresh_rate_ms": 5}, "discovery.dns_refresh_rate_ms"),
        ({"dns_lookup_family": "V4"}, "discovery.dns_lookup_family"),
        ({"respect_dns_ttl": "sometimes"}, "discovery.respect_dns_ttl"),
        ({"backend": "mdns"}, "discovery.backend"),
    ],
)
def test_bad_dns_settings_are_refused_naming_the_field(
    discovery: dict[str, Any], field: str
) -> None:
    text = yaml.safe_dump({"discovery": {"backend": "dns", **discovery}})
    with pytest.raises(SpecError) as refused:
        parse_spec(text, "mesh.yaml")
    assert field in str(refused.value)


def test_the_control_plane_the_scaler_and_fleet_updates_refuse_a_dns_mesh_naming_it() -> None:
    spec = _spec()
    with pytest.raises(NoCatalog, match="discovery.backend: dns"):
        catalog_for(spec)
    assert busy_with_an_update(spec).startswith("discovery.backend 'dns'")
    with pytest.raises(FleetError, match="discovery.backend.*'dns'"):
        _supported(spec)  # blue-green and rolling updates


def test_envoy_s_hosts_answer_to_the_name_they_were_resolved_from() -> None:
    def host(port: int, healthy: bool) -> dict[str, Any]:
        status: dict[str, Any] = {"eds_health_status": "HEALTHY"}
        if not healthy:
            status["failed_active_health_check"] = True
        return {
            "address": {"socket_address": {"address": "10.0.0.%d" % port, "port_value": 50051}},
            "hostname": "model-zone-a",
            "health_status": status,
            "stats": [{"name": "rq_active", "value": port}],
        }

    text = json.dumps(
        {"cluster_statuses": [{"name": "c", "host_statuses": [host(1, True), host(2, False)]}]}
    )
    hosts = _hosts_of(text)["c"]
    assert hosts["10.0.0.1:50051"].healthy and not hosts["10.0.0.2:50051"].healthy
    named = hosts["model-zone-a:50051"]
    assert not named.healthy and named.in_flight == 3
