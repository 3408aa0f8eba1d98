"""The per-zone layout's config, rendered and checked by Envoy itself (`--mode validate`):
each Envoy holds only its part (each zone's edge the same edge listener on its own port and
the gateways' clusters, a zone its mesh listener and the clusters its callers reach), every
cluster a route names is in the same Envoy, each has its own admin socket, stats port and
logs, and only the edge retries a call a gateway says never left its zone. The shared layout
renders as it always did."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from servemesh.contract.wire import GATEWAY_CLUSTER, RETRY_ELSEWHERE_HEADER, zone_of_cluster
from servemesh.proxy.admin import admin_socket_path
from servemesh.proxy.offline import validate_offline
from servemesh.proxy.render import render_proxies, render_resources, static_bootstrap
from servemesh.spec import (
    EDGE_PROXY,
    MeshSpec,
    Ports,
    ProxySpec,
    ResolvedSpec,
    SpecError,
    is_edge_proxy,
    parse_spec,
    resolve,
)

FREE = Ports.free()


def per_zone(tmp_path: Path) -> ResolvedSpec:
    return resolve(
        MeshSpec(ports=FREE, state_dir=str(tmp_path), proxy=ProxySpec(layout="per_zone"))
    )


def named_clusters(route_configs: Mapping[str, object]) -> set[str]:
    """Every cluster a route names: plain, weighted, mirrored."""
    text = json.dumps(route_configs)
    return set(re.findall(r'"cluster": "([^"]+)"', text)) | set(
        re.findall(r'"name": "([^"]+-via-[^"]+)"', text)
    )


def test_each_envoy_holds_its_part_and_every_route_finds_its_cluster(tmp_path: Path) -> None:
    spec = per_zone(tmp_path)
    parts = render_proxies(spec, tmp_path)
    assert list(parts) == [EDGE_PROXY, "edge-zone-b", "zone-a", "zone-b"]
    for proxy, resources in parts.items():
        held = {c["name"] for c in resources.clusters}
        assert named_clusters(resources.route_configs) <= held, proxy
        zones = {zone_of_cluster(name) for name in held} - {None}
        assert zones == (set() if is_edge_proxy(proxy) else {proxy}), (proxy, zones)
    edge = parts[EDGE_PROXY]
    assert GATEWAY_CLUSTER in {c["name"] for c in edge.clusters}
    assert {listener["name"] for listener in edge.listeners} == {"edge", "envoy-stats"}
    # Zone-b's edge holds the same routes and clusters, its edge listener on its own port.
    other = parts["edge-zone-b"]
    assert other.route_configs == edge.route_configs
    assert other.clusters == edge.clusters
    ports = {
        proxy: [x for x in parts[proxy].listeners if x["name"] == "edge"][0]["address"][
            "socket_address"
        ]["port_value"]
        for proxy in (EDGE_PROXY, "edge-zone-b")
    }
    assert ports == {EDGE_PROXY: spec.ports.edge, "edge-zone-b": spec.edge_ports["edge-zone-b"]}
    assert len(set(ports.values())) == 2
    assert {listener["name"] for listener in parts["zone-a"].listeners} == {
        "mesh-zone-a",
        "envoy-stats",
    }
    # Together they hold what the shared layout's one Envoy does (a few held by each).
    one = spec.model_copy(update={"proxy": ProxySpec(layout="shared")})
    shared = render_resources(resolve(one), tmp_path)
    union = {c["name"] for part in parts.values() for c in part.clusters}
    assert union == {c["name"] for c in shared.clusters}


def test_each_envoy_has_its_own_admin_socket_stats_port_and_logs(tmp_path: Path) -> None:
    spec = per_zone(tmp_path)
    seen: dict[str, tuple[str, int, str]] = {}
    for proxy, resources in render_proxies(spec, tmp_path).items():
        bootstrap = static_bootstrap(spec, resources, tmp_path, proxy)
        admin = bootstrap["admin"]["address"]["pipe"]["path"]
        assert admin == str(admin_socket_path(spec.state_dir, proxy))
        [stats] = [x for x in resources.listeners if x["name"] == "envoy-stats"]
        port = stats["address"]["socket_address"]["port_value"]
        assert port == spec.proxy_stats_port(proxy)
        log = bootstrap["admin"]["access_log"][0]["typed_config"]["path"]
        seen[proxy] = (admin, port, log)
    for field in range(3):
        assert len({entry[field] for entry in seen.values()}) == 4, seen


def test_every_envoys_config_is_one_envoy_accepts(tmp_path: Path) -> None:
    validate_offline(per_zone(tmp_path), tmp_path)
    assert {p.name for p in tmp_path.glob("envoy*.yaml")} == {
        "envoy.yaml",
        "envoy-edge-zone-b.yaml",
        "envoy-zone-a.yaml",
        "envoy-zone-b.yaml",
    }


def _edge_retry(route_configs: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    routes = route_configs["edge"]["virtual_hosts"][0]["routes"]
    [gateway] = [r for r in routes if r.get("name") == "gateway"]
    return dict(gateway["route"]["retry_policy"])


def test_only_the_per_zone_edge_retries_a_call_a_gateway_says_never_left(tmp_path: Path) -> None:
    per = render_proxies(per_zone(tmp_path), tmp_path)[EDGE_PROXY]
    retry = _edge_retry(per.route_configs)
    assert "retriable-headers" in str(retry["retry_on"]).split(",")
    assert retry["retriable_headers"] == [{"name": RETRY_ELSEWHERE_HEADER, "present_match": True}]
    assert "retry_host_predicate" in retry  # on another gateway
    one = MeshSpec(ports=FREE, state_dir=str(tmp_path), proxy=ProxySpec(layout="shared"))
    shared = render_resources(resolve(one), tmp_path)
    assert "retriable_headers" not in _edge_retry(shared.route_configs)


def test_an_envoy_per_zone_is_the_default_and_runs_with_namespaces_and_consul() -> None:
    assert parse_spec("").proxies() == [EDGE_PROXY, "edge-zone-b", "zone-a", "zone-b"]
    assert parse_spec("proxy: {edges: one}\n").proxies() == [EDGE_PROXY, "zone-a", "zone-b"]
    assert parse_spec("profile: small-host\n").edge_proxies() == [EDGE_PROXY]
    assert parse_spec("network: {mode: netns}\n").proxy.layout == "per_zone"
    assert parse_spec("discovery: {backend: consul}\n").proxy.layout == "per_zone"
    assert parse_spec("proxy: {layout: shared}\n").proxies() == [EDGE_PROXY]


def test_each_zone_has_an_edge_whose_access_log_is_its_own(tmp_path: Path) -> None:
    spec = per_zone(tmp_path)
    logs = {}
    for proxy in spec.edge_proxies():
        [edge] = [
            x for x in render_resources(spec, tmp_path, proxy).listeners if x["name"] == "edge"
        ]
        logs[proxy] = re.findall(r"envoy-[a-z0-9-]+-access\.log", json.dumps(edge))
    # The first zone's keeps the single edge's file name, which tools read.
    assert logs == {
        EDGE_PROXY: ["envoy-edge-access.log"],
        "edge-zone-b": ["envoy-edge-zone-b-access.log"],
    }
    assert spec.zone_of_edge("edge-zone-b") == "zone-b"
    assert spec.edge_addresses == [
        f"127.0.0.1:{spec.ports.edge}",
        f"127.0.0.1:{spec.edge_ports['edge-zone-b']}",
    ]


def test_a_zone_may_not_take_an_edges_name() -> None:
    with pytest.raises(SpecError, match="may not start with 'edge-'"):
        parse_spec("zones: [zone-a, edge-b]\n")
