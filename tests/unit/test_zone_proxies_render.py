"""The per-zone layout's config, rendered and checked by Envoy itself (`--mode validate`):
each Envoy holds only its part (the edge its listener and the gateways' clusters, a zone its
mesh listener and the clusters its callers reach), every cluster a route names is in the
same Envoy, each has its own admin socket, stats port and logs, and only the edge retries a
call a gateway says never left its zone. The shared layout renders as it always did."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    assert list(parts) == [EDGE_PROXY, "zone-a", "zone-b"]
    for proxy, resources in parts.items():
        held = {c["name"] for c in resources.clusters}
        assert named_clusters(resources.route_configs) <= held, proxy
        zones = {zone_of_cluster(name) for name in held} - {None}
        assert zones == (set() if proxy == EDGE_PROXY else {proxy}), (proxy, zones)
    edge = parts[EDGE_PROXY]
    assert GATEWAY_CLUSTER in {c["name"] for c in edge.clusters}
    assert {listener["name"] for listener in edge.listeners} == {"edge", "envoy-stats"}
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
        assert len({entry[field] for entry in seen.values()}) == 3, seen


def test_every_envoys_config_is_one_envoy_accepts(tmp_path: Path) -> None:
    validate_offline(per_zone(tmp_path), tmp_path)
    assert {p.name for p in tmp_path.glob("envoy*.yaml")} == {
        "envoy.yaml",
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
    assert parse_spec("").proxies() == [EDGE_PROXY, "zone-a", "zone-b"]
    assert parse_spec("network: {mode: netns}\n").proxy.layout == "per_zone"
    assert parse_spec("discovery: {backend: consul}\n").proxy.layout == "per_zone"
    assert parse_spec("proxy: {layout: shared}\n").proxies() == [EDGE_PROXY]
