"""The Envoy config rendered from the spec: accepted by Envoy, and saying what we mean."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from servemesh.contract.wire import (
    BUCKET_HEADER,
    BUCKETS,
    CONTROL_METHODS,
    ENVOY_ADMIN_CLUSTER,
    ENVOY_STATS_LISTENER,
    GATEWAY_CLUSTER,
    GATEWAY_SERVICE,
    HEALTH_SERVICE,
    MODEL_HEADER,
    OIP_SERVICE,
    REGISTRY_CLUSTER,
    REGISTRY_SERVICE,
    SHADOW_ROLE_HEADER,
    TRACE_COLLECTOR_CLUSTER,
    VERSION_HEADER,
    bucket_ranges,
    method_path,
    model_cluster,
    model_servers_cluster,
    shadow_cluster,
    version_health_name,
    zone_of_cluster,
)
from servemesh.identity import issue_mesh_certificates
from servemesh.procs.netns import zone_source_address
from servemesh.proxy.admin import admin_socket_path
from servemesh.proxy.offline import validate_offline
from servemesh.proxy.process import EnvoyConfigError, validate_config
from servemesh.proxy.render import (
    JWT_CACHE_SIZE,
    dynamic_bootstrap,
    render_resources,
    static_bootstrap,
    xds_files,
)
from servemesh.proxy.tracing import FORCED_TRACES_FILTER
from servemesh.spec import (
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    NetworkSpec,
    Ports,
    ResolvedSpec,
    TlsSpec,
    TracingSpec,
    resolve,
)
from servemesh.spec.policy import (
    CircuitBreakers,
    EdgeAuth,
    Overload,
    RateLimit,
    RoutePolicy,
    ShadowSpec,
    TrafficSpec,
)
from servemesh.state.paths import XdsLayout

REPO = Path(__file__).resolve().parents[2]
# An htpasswd line for user "edge" (any 27 base64 characters and "=" pass the spec's check).
_USER = "edge:{SHA}" + "A" * 27 + "="


def _spec(**overrides: object) -> ResolvedSpec:
    """A spec on free ports in the shared layout, whose one Envoy holds every listener and
    cluster: what each part renders to (the per-zone layout splits the same parts over its
    Envoys, tests/unit/test_zone_proxies_render.py)."""
    ports = {"edge": 0, "mesh": 0, "envoy_admin": 0, "services_base": 0}
    declared = {"ports": ports, "proxy": {"layout": "shared"}, **overrides}
    return resolve(MeshSpec.model_validate(declared))


def _routes(spec: ResolvedSpec, config: str) -> list[dict[str, Any]]:
    resources = render_resources(spec, Path("/tmp"))
    return resources.route_configs[config]["virtual_hosts"][0]["routes"]


def _validate(spec: ResolvedSpec, tmp_path: Path) -> None:
    validate_offline(spec, tmp_path)


def test_default_spec_renders_a_config_envoy_accepts(tmp_path: Path) -> None:
    _validate(_spec(), tmp_path)


def test_servemesh_check_takes_a_small_host_spec_by_name_or_flag_and_names_its_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from servemesh.cli import main

    spec = tmp_path / "small.yaml"
    spec.write_text("profile: small-host\n")
    for argv in (["check", str(spec)], ["check", "--spec", str(spec)]):
        assert main(argv) == 0
        assert f"ok: {spec} (profile small-host) is valid" in capsys.readouterr().out
    other = tmp_path / "other.yaml"
    other.write_text("")
    assert main(["check", str(spec), "--spec", str(other)]) == 2
    assert "two specs given" in capsys.readouterr().err


def test_dynamic_bootstrap_and_watched_files_are_accepted_too(tmp_path: Path) -> None:
    spec = _spec(state_dir=str(tmp_path / "state"))
    issue_mesh_certificates(spec)  # Envoy refuses SDS files that are not there
    resources = render_resources(spec, tmp_path)
    layout = XdsLayout(tmp_path / "xds")
    for path, content in xds_files(resources, layout, "7").items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(content))
    config = tmp_path / "envoy.yaml"
    config.write_text(yaml.safe_dump(dynamic_bootstrap(spec, resources, layout, tmp_path)))
    validate_config(config)
    cds = yaml.safe_load(layout.cds.read_text())
    assert cds["version_info"] == "7"
    assert all(c["type"] == "EDS" for c in cds["resources"])


def test_zones_in_namespaces_send_from_their_own_source_and_loopback_zones_do_not(
    tmp_path: Path,
) -> None:
    shadowed = ModelSpec(
        versions={"v1": ModelVersionSpec(source="demo:1"), "v2": ModelVersionSpec(source="demo:2")},
        shadow=ShadowSpec(version="v2"),
    )
    netns = _spec(network=NetworkSpec(mode="netns"), models={"fraud": shadowed})
    clusters = render_resources(netns, tmp_path).clusters
    per_zone = [c for c in clusters if zone_of_cluster(c["name"]) is not None]
    # feature, model-servers, two versions and the shadow, for each of two zones
    assert len(per_zone) == 10
    for cluster in per_zone:
        zone = zone_of_cluster(cluster["name"])
        source = zone_source_address(netns.zones.index(str(zone)))
        assert cluster["upstream_bind_config"] == {
            "source_address": {"address": source, "port_value": 0}
        }, cluster["name"]
    assert {zone_source_address(i) for i in range(2)} == {"127.0.1.1", "127.0.2.1"}
    # Zone-less clusters (the edge's gateways, the registry) keep the default source.
    assert all("upstream_bind_config" not in c for c in clusters if c not in per_zone)
    _validate(netns, tmp_path)

    loopback = _spec(models={"fraud": shadowed})
    assert loopback.network.mode == "loopback"
    plain = render_resources(loopback, tmp_path).clusters
    assert plain and all("upstream_bind_config" not in c for c in plain)


def test_envoy_rejects_a_broken_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("static_resources: {clusters: [{name: x, type: NOPE}]}\n")
    with pytest.raises(EnvoyConfigError):
        validate_config(bad)


def test_model_routes_pin_versions_and_split_the_rest_by_weight() -> None:
    spec = _spec(models={"fraud": ModelSpec(traffic={"v1": 90, "v2": 10})})
    routes = _routes(spec, "mesh-zone-a")
    names = [r["name"] for r in routes]
    # Pinned routes must come before the split, or the split would swallow pinned calls.
    assert names.index("fraud-v1-pinned") < names.index("fraud-split")
    split = next(r for r in routes if r["name"] == "fraud-split")["route"]["weighted_clusters"][
        "clusters"
    ]
    assert {(c["name"], c["weight"]) for c in split} == {
        ("model-fraud-v1-via-zone-a", 90),
        ("model-fraud-v2-via-zone-a", 10),
    }
    assert {c["request_headers_to_add"][0]["header"]["value"] for c in split} == {"v1", "v2"}


def test_sticky_routes_send_bucket_ranges_to_versions_between_pinned_and_split(
    tmp_path: Path,
) -> None:
    spec = _spec(
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="demo:2"),
                    "v3": ModelVersionSpec(source="demo:3"),
                },
                traffic={"v1": 90, "v2": 10, "v3": 0},
            )
        }
    )
    routes = _routes(spec, "mesh-zone-b")
    names = [r["name"] for r in routes]
    # Pinned first (a pinned call carries no bucket), the split last (calls without one).
    assert names.index("fraud-v3-pinned") < names.index("fraud-v1-bucket")
    assert names.index("fraud-v2-bucket") < names.index("fraud-split")
    assert "fraud-v3-bucket" not in names  # weight 0: no range
    by_name = {r["name"]: r for r in routes}
    for version, (start, end) in (("v1", (0, 9000)), ("v2", (9000, BUCKETS))):
        route = by_name[f"fraud-{version}-bucket"]
        headers = {h["name"]: h for h in route["match"]["headers"]}
        assert headers[BUCKET_HEADER]["range_match"] == {"start": start, "end": end}
        assert headers[MODEL_HEADER]["string_match"] == {"exact": "fraud"}
        # One cluster, so retries stay within the version; the replica is told which.
        assert route["route"]["cluster"] == f"model-fraud-{version}-via-zone-b"
        assert "weighted_clusters" not in route["route"]
        assert "retry_policy" in route["route"]
        added = {h["header"]["key"]: h["header"]["value"] for h in route["request_headers_to_add"]}
        assert added == {VERSION_HEADER: version}
        answered = route["response_headers_to_add"][0]["header"]
        assert answered == {"key": VERSION_HEADER, "value": version}
    # Every route of the model names its version in the answer, the split per cluster too.
    assert by_name["fraud-v3-pinned"]["response_headers_to_add"][0]["header"]["value"] == "v3"
    split = by_name["fraud-split"]["route"]["weighted_clusters"]["clusters"]
    assert {c["response_headers_to_add"][0]["header"]["value"] for c in split} == {"v1", "v2", "v3"}
    _validate(spec, tmp_path)


def test_bucket_ranges_tile_the_buckets_and_a_growing_canary_keeps_its_entities() -> None:
    previous: tuple[int, int] | None = None
    for weight in (1, 5, 25, 50, 100):
        ranges = bucket_ranges({"v1": 100 - weight, "v2": weight})
        assert sum(end - start for start, end in ranges.values()) == BUCKETS
        start, end = ranges["v2"]
        assert end - start == weight * BUCKETS // 100
        if previous is not None:  # the canary's range only grows: nobody flips back
            assert start <= previous[0] and previous[1] <= end
        previous = (start, end)
    assert bucket_ranges({"v1": 100, "v2": 0}) == {"v1": (0, BUCKETS)}
    assert bucket_ranges({"a": 33, "b": 33, "c": 34}) == {
        "a": (0, 3300),
        "b": (3300, 6600),
        "c": (6600, BUCKETS),
    }


def test_sticky_routes_mirror_and_mark_the_primary_as_the_split_does(tmp_path: Path) -> None:
    spec = _spec(
        models={"fraud": ModelSpec(traffic={"v1": 50, "v2": 50}, shadow=ShadowSpec(version="v2"))}
    )
    routes = {r["name"]: r for r in _routes(spec, "mesh-zone-a")}
    for name in ("fraud-v1-bucket", "fraud-v2-bucket", "fraud-split"):
        [mirror] = routes[name]["route"]["request_mirror_policies"]
        assert mirror["cluster"] == "shadow-fraud-v2-via-zone-a", name
        marks = {
            h["header"]["key"]: h["header"]["value"] for h in routes[name]["request_headers_to_add"]
        }
        assert marks[SHADOW_ROLE_HEADER] == "primary", name
    _validate(spec, tmp_path)


def test_each_zone_listener_prefers_its_own_zone_and_fails_over_to_the_others() -> None:
    spec = _spec()
    resources = render_resources(spec, Path("/tmp"))
    for zone, other in (("zone-a", "zone-b"), ("zone-b", "zone-a")):
        endpoints = resources.load_assignments[model_cluster("fraud", "v1", zone)]["endpoints"]
        priorities = {e["locality"]["zone"]: e["priority"] for e in endpoints}
        assert priorities == {zone: 0, other: 1}
    listeners = {
        l_["name"]: l_["address"]["socket_address"]["port_value"] for l_ in resources.listeners
    }
    assert listeners["mesh-zone-a"] == spec.mesh_ports["zone-a"]
    assert listeners["mesh-zone-b"] == spec.mesh_ports["zone-b"]


def test_grpc_routes_honour_caller_deadlines_and_retry_killed_upstreams_in_other_zones() -> None:
    split = next(r for r in _routes(_spec(), "mesh-zone-a") if r["name"] == "fraud-split")["route"]
    assert split["timeout"] == "0.000s"
    assert split["max_stream_duration"]["grpc_timeout_header_max"] == "0.000s"
    retry = split["retry_policy"]
    assert {"connect-failure", "reset", "refused-stream", "unavailable"} <= set(
        retry["retry_on"].split(",")
    )
    assert retry["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"


def test_edge_retries_only_what_never_reached_a_gateway() -> None:
    [route] = [r for r in _routes(_spec(), "edge") if r["name"] == "gateway"]
    assert route["route"]["retry_policy"]["retry_on"] == "connect-failure,refused-stream"


def test_every_cluster_has_health_checks_breakers_and_a_retry_budget() -> None:
    clusters = render_resources(_spec(), Path("/tmp")).clusters
    names = {c["name"] for c in clusters}
    assert {"gateway", "registry", "feature-via-zone-a", "model-fraud-v2-via-zone-b"} <= names
    # The admin socket's cluster (Envoy's stats listener) is Envoy itself, not a service;
    # spans are best effort: no checks, breakers or ejection for the trace collector.
    skipped = (ENVOY_ADMIN_CLUSTER, TRACE_COLLECTOR_CLUSTER)
    for cluster in (c for c in clusters if c["name"] not in skipped):
        [check] = cluster["health_checks"]
        assert "grpc_health_check" in check and check["no_traffic_interval"] == "1.000s"
        [thresholds] = cluster["circuit_breakers"]["thresholds"]
        assert thresholds["retry_budget"]["budget_percent"]["value"] == 25.0
        assert cluster["outlier_detection"]["max_ejection_percent"] == 50


def test_a_version_cluster_checks_that_version_s_own_health() -> None:
    spec = _spec(
        models={"fraud": ModelSpec(traffic={"v1": 100, "v2": 0}, shadow=ShadowSpec(version="v2"))}
    )
    clusters = {c["name"]: c for c in render_resources(spec, Path("/tmp")).clusters}

    def checked(name: str) -> dict[str, Any]:
        [check] = clusters[name]["health_checks"]
        return dict(check["grpc_health_check"])

    for zone in ("zone-a", "zone-b"):
        for version in ("v1", "v2"):
            assert checked(model_cluster("fraud", version, zone)) == {
                "service_name": version_health_name("fraud", version)
            }
        assert checked(shadow_cluster("fraud", "v2", zone)) == {
            "service_name": version_health_name("fraud", "v2")
        }
        # Any model server will do for OIP calls without a model: its overall health.
        assert checked(model_servers_cluster(zone)) == {}
    assert checked("gateway") == {}


def test_a_model_policy_overrides_the_default_for_its_clusters_only(tmp_path: Path) -> None:
    tight = RoutePolicy(circuit_breakers=CircuitBreakers(max_requests=2, max_pending_requests=1))
    spec = _spec(
        models={
            "fraud": ModelSpec(),
            "slow": ModelSpec(
                versions={"v1": ModelVersionSpec()}, traffic={"v1": 100}, policy=tight
            ),
        }
    )
    clusters = {c["name"]: c for c in render_resources(spec, tmp_path).clusters}
    assert (
        clusters["model-slow-v1-via-zone-a"]["circuit_breakers"]["thresholds"][0]["max_requests"]
        == 2
    )
    assert (
        clusters["model-fraud-v1-via-zone-a"]["circuit_breakers"]["thresholds"][0]["max_requests"]
        == 1024
    )
    _validate(spec, tmp_path)


def test_shadow_mirrors_the_split_to_the_shadow_versions_cluster(tmp_path: Path) -> None:
    spec = _spec(models={"fraud": ModelSpec(shadow=ShadowSpec(version="v2", percent=50))})
    split = next(r for r in _routes(spec, "mesh-zone-b") if r["name"] == "fraud-split")
    [mirror] = split["route"]["request_mirror_policies"]
    assert mirror["cluster"] == "shadow-fraud-v2-via-zone-b"
    assert mirror["runtime_fraction"]["default_value"] == {
        "numerator": 50,
        "denominator": "HUNDRED",
    }
    role = split["request_headers_to_add"][0]["header"]
    assert role == {"key": "x-servemesh-shadow-role", "value": "primary"}
    # The shadow cluster re-marks the copy: it is a shadow, for v2, whatever the primary said.
    clusters = {c["name"]: c for c in render_resources(spec, tmp_path).clusters}
    options = clusters["shadow-fraud-v2-via-zone-b"]["typed_extension_protocol_options"]
    filters = next(iter(options.values()))["http_filters"]
    mutations = filters[0]["typed_config"]["mutations"]["request_mutations"]
    assert {(m["append"]["header"]["key"], m["append"]["header"]["value"]) for m in mutations} == {
        ("x-servemesh-model-version", "v2"),
        ("x-servemesh-shadow-role", "shadow"),
    }
    assert filters[-1]["name"] == "envoy.filters.http.upstream_codec"
    _validate(spec, tmp_path)


def test_faults_are_off_by_default_and_driven_by_runtime_keys() -> None:
    split = next(r for r in _routes(_spec(), "mesh-zone-a") if r["name"] == "fraud-split")
    fault = split["typed_per_filter_config"]["envoy.filters.http.fault"]
    assert fault["abort"]["percentage"]["numerator"] == 0
    assert fault["delay"]["percentage"]["numerator"] == 0
    assert fault["abort_percent_runtime"] == "fault.model.fraud.abort_percent"
    assert fault["delay_duration_runtime"] == "fault.model.fraud.delay_ms"


def test_the_edge_sheds_over_its_rate_limit_with_resource_exhausted() -> None:
    [edge] = [
        l_ for l_ in render_resources(_spec(), Path("/tmp")).listeners if l_["name"] == "edge"
    ]
    filters = edge["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    limits = [f for f in filters if f["name"] == "envoy.filters.http.local_ratelimit"]
    # Before auth: the overall bucket and one per client address; after it, one per caller.
    assert [f["typed_config"]["stat_prefix"] for f in limits] == [
        "edge_rate_limit",
        "edge_caller_rate_limit",
    ]
    for limit in limits:
        assert limit["typed_config"]["rate_limited_as_resource_exhausted"] is True
    first, by_caller = (f["typed_config"] for f in limits)
    assert first["token_bucket"]["max_tokens"] == 10_000
    assert first["rate_limits"] == [{"actions": [{"remote_address": {}}]}]
    [per_address] = first["descriptors"]
    assert per_address["entries"] == [{"key": "remote_address", "value": ""}]
    assert per_address["token_bucket"]["max_tokens"] == 2000
    assert first["max_dynamic_descriptors"] == 10_000
    assert "token_bucket" not in by_caller  # a call without a caller name passes it
    [action] = by_caller["rate_limits"][0]["actions"]
    assert action["request_headers"]["header_name"] == "x-servemesh-caller"


def test_long_lived_streams_have_their_own_route_cluster_and_breaker() -> None:
    spec = _spec()
    routes = {r["name"]: r for r in _routes(spec, "edge")}
    streams = [r for r in routes.values() if r["route"].get("cluster") == "gateway-streams"]
    # (Each has a twin for forced traces: test_a_sampled_traceparent_has_a_budget_at_the_edge.)
    streams = [r for r in streams if not r["name"].endswith("-forced-trace")]
    assert sorted(r["match"]["path"] for r in streams) == sorted(
        [
            method_path(HEALTH_SERVICE, "Watch"),
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ]
    )
    for route in streams:
        assert "retry_policy" not in route["route"]
        assert route["route"]["max_stream_duration"] == {
            "max_stream_duration": "60.000s",
            "grpc_timeout_header_max": "60.000s",
        }
    # Before the catch-all gateway route.
    names = list(routes)
    assert max(names.index(r["name"]) for r in streams) < names.index("gateway")
    clusters = {c["name"]: c for c in render_resources(spec, Path("/tmp")).clusters}
    breaker = clusters["gateway-streams"]["circuit_breakers"]["thresholds"][0]
    assert breaker["max_requests"] == 256
    assert clusters[GATEWAY_CLUSTER]["circuit_breakers"]["thresholds"][0]["max_requests"] == 1024


def test_each_listener_caps_its_connections_streams_handshakes_and_headers() -> None:
    spec = _spec()
    listeners = {x["name"]: x for x in render_resources(spec, Path("/tmp")).listeners}
    for name, listener in listeners.items():
        if name == ENVOY_STATS_LISTENER:
            continue
        chain = listener["filter_chains"][0]
        assert chain["transport_socket_connect_timeout"] == "5.000s"
        hcm = chain["filters"][0]["typed_config"]
        assert hcm["request_headers_timeout"] == "10.000s"
        streams = hcm["http2_protocol_options"]["max_concurrent_streams"]
        assert streams == (100 if name == "edge" else 1024), name
    boot = static_bootstrap(spec, render_resources(spec, Path("/tmp")), Path("/tmp"))
    runtime = boot["layered_runtime"]["layers"][0]["static_layer"]
    caps = {
        k.split(".")[3]: v
        for k, v in runtime.items()
        if k.startswith("envoy.resource_limits.listener.")
    }
    assert caps == {
        "edge": 5000,
        "mesh-zone-a": 2000,
        "mesh-zone-b": 2000,
        ENVOY_STATS_LISTENER: 64,
    }


@pytest.mark.parametrize(
    ("proxy", "example"), [("envoy", "mesh-default.yaml"), ("zone-a", "mesh-default-zone-a.yaml")]
)
def test_the_committed_example_config_is_what_the_default_spec_renders(
    proxy: str, example: str
) -> None:
    rendered = subprocess.run(
        [sys.executable, "-m", "servemesh", "envoy-config", "--spec", "mesh.yaml",
         "--proxy", proxy],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout  # fmt: skip
    assert rendered == (REPO / "envoy" / example).read_text(), (
        f"refresh with: servemesh envoy-config --spec mesh.yaml --proxy {proxy} > envoy/{example}"
    )


# --- control calls, admin, runtime, the hardened edge ------------------------------------


def _hcms(spec: ResolvedSpec) -> dict[str, dict[str, Any]]:
    """The gRPC listeners' connection managers (not Envoy's own stats listener)."""
    return {
        listener["name"]: listener["filter_chains"][0]["filters"][0]["typed_config"]
        for listener in render_resources(spec, Path("/tmp")).listeners
        if listener["name"] != ENVOY_STATS_LISTENER
    }


def _filter_names(hcm: dict[str, Any]) -> list[str]:
    return [f["name"] for f in hcm["http_filters"]]


def test_every_listener_denies_exactly_the_control_methods() -> None:
    hcms = _hcms(_spec())
    assert set(hcms) == {"edge", "mesh-zone-a", "mesh-zone-b"}
    for name, hcm in hcms.items():
        [rbac] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.rbac"]
        rules = rbac["typed_config"]["rules"]
        assert rules["action"] == "DENY", name
        [policy] = rules["policies"].values()
        denied = {p["url_path"]["path"]["exact"] for p in policy["permissions"]}
        assert denied == set(CONTROL_METHODS), name
        assert method_path(REGISTRY_SERVICE, "DownloadArtifact") not in denied
        # Paths are normalised before the rule sees them: no `//` or %2F spelling dodges it.
        assert hcm["normalize_path"] and hcm["merge_slashes"], name
        assert hcm["path_with_escaped_slashes_action"] == "REJECT_REQUEST", name


def test_admin_is_a_unix_socket_in_the_state_dir_never_a_port(tmp_path: Path) -> None:
    spec = resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(tmp_path),
        )
    )
    admin = static_bootstrap(spec, render_resources(spec, tmp_path), tmp_path)["admin"]
    assert admin["address"] == {
        "pipe": {"path": str(tmp_path / "admin" / "envoy.sock"), "mode": 0o600}
    }


def test_a_state_dir_too_long_for_a_socket_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="state_dir"):
        admin_socket_path(tmp_path / ("x" * 120))


def test_the_admin_runtime_layer_exists_only_in_the_drill_profile() -> None:
    def layers(spec: ResolvedSpec) -> list[str]:
        bootstrap = static_bootstrap(spec, render_resources(spec, Path("/tmp")), Path("/tmp"))
        return [layer["name"] for layer in bootstrap["layered_runtime"]["layers"]]

    assert layers(_spec()) == ["static"]
    drill = _spec(traffic=TrafficSpec(runtime_overrides=True))
    assert layers(drill) == ["static", "admin"]


def test_the_edge_trusts_nothing_the_caller_says_about_itself() -> None:
    hcms = _hcms(_spec())
    for name, hcm in hcms.items():
        assert hcm["use_remote_address"] is True, name
        # Not even loopback is internal: Envoy drops a caller's x-envoy-* headers.
        [nobody] = hcm["internal_address_config"]["cidr_ranges"]
        assert nobody["address_prefix"] == "192.0.2.0", name
        assert hcm["generate_request_id"] is True, name
    # The edge makes its own request ids; the mesh keeps the gateway's.
    assert hcms["edge"]["preserve_external_request_id"] is False
    assert hcms["mesh-zone-a"]["preserve_external_request_id"] is True
    # gRPC only between services.
    assert hcms["edge"]["codec_type"] == "AUTO"
    assert hcms["mesh-zone-a"]["codec_type"] == hcms["mesh-zone-b"]["codec_type"] == "HTTP2"


def test_internal_headers_are_removed_from_callers_on_every_virtual_host() -> None:
    resources = render_resources(_spec(), Path("/tmp"))
    for name, config in resources.route_configs.items():
        if name == ENVOY_STATS_LISTENER:  # one route, to Envoy's own stats
            continue
        # The removal runs before the routes' own additions (the primary's shadow role).
        assert config["most_specific_header_mutations_wins"] is True, name
        for host in config["virtual_hosts"]:
            assert SHADOW_ROLE_HEADER in host["request_headers_to_remove"], name
    [edge] = resources.route_configs["edge"]["virtual_hosts"]
    assert set(edge["request_headers_to_remove"]) == {
        MODEL_HEADER,
        VERSION_HEADER,
        SHADOW_ROLE_HEADER,
        BUCKET_HEADER,
    }


def test_per_method_stats_only_for_the_mesh_s_own_methods() -> None:
    for name, hcm in _hcms(_spec()).items():
        [stats] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.grpc_stats"]
        config = stats["typed_config"]
        assert "stats_for_all_methods" not in config, name
        allowed = {
            (s["name"], m)
            for s in config["individual_method_stats_allowlist"]["services"]
            for m in s["method_names"]
        }
        assert (OIP_SERVICE, "ModelInfer") in allowed
        assert (GATEWAY_SERVICE, "Predict") in allowed
        assert (HEALTH_SERVICE, "Check") in allowed


def test_edge_rate_limit_comes_before_auth_and_health_check_alone_is_open() -> None:
    spec = _spec(traffic=TrafficSpec(edge_auth=EdgeAuth(enabled=True, users=[_USER])))
    names = _filter_names(_hcms(spec)["edge"])
    assert (
        names.index("envoy.filters.http.local_ratelimit")
        < names.index("envoy.filters.http.rbac")
        < names.index("envoy.filters.http.basic_auth")
    )
    [health] = [r for r in _routes(spec, "edge") if r["name"] == "health"]
    assert health["match"] == {"path": method_path(HEALTH_SERVICE, "Check")}


def test_the_edge_keeps_verified_tokens_and_checks_each_against_the_mesh_s_keys() -> None:
    spec = _spec(traffic=TrafficSpec(edge_auth=EdgeAuth(mode="jwt")))
    [jwt] = [f for f in _hcms(spec)["edge"]["http_filters"] if f["name"].endswith("jwt_authn")]
    [provider] = jwt["typed_config"]["providers"].values()
    # A verified token's signature is not checked again while it lives (bounded cache).
    assert provider["jwt_cache_config"] == {"jwt_cache_size": JWT_CACHE_SIZE}
    assert provider["require_expiration"] and not provider["forward"]
    assert provider["local_jwks"]["filename"].endswith("jwks.json")


def test_the_edge_caps_a_caller_s_deadline() -> None:
    [gateway] = [r for r in _routes(_spec(), "edge") if r["name"] == "gateway"]
    assert gateway["route"]["max_stream_duration"]["grpc_timeout_header_max"] == "60.000s"


def test_the_overload_manager_bounds_heap_and_client_connections() -> None:
    spec = _spec(traffic=TrafficSpec(overload=Overload(max_heap_mb=512)))
    bootstrap = static_bootstrap(spec, render_resources(spec, Path("/tmp")), Path("/tmp"))
    overload = bootstrap["overload_manager"]
    monitors = {m["name"]: m["typed_config"] for m in overload["resource_monitors"]}
    heap = monitors["envoy.resource_monitors.fixed_heap"]
    assert heap["max_heap_size_bytes"] == 512 * 1024 * 1024
    connections = monitors["envoy.resource_monitors.global_downstream_max_connections"]
    assert connections["max_active_downstream_connections"] == 10_000
    actions = {a["name"] for a in overload["actions"]}
    assert "envoy.overload_actions.stop_accepting_requests" in actions


def test_every_hardening_switch_on_at_once_is_a_config_envoy_accepts(tmp_path: Path) -> None:
    traffic = TrafficSpec(
        edge_auth=EdgeAuth(enabled=True, users=[_USER]),
        runtime_overrides=True,
        overload=Overload(max_heap_mb=256, max_downstream_connections=100),
    )
    _validate(_spec(traffic=traffic), tmp_path)


# --- TLS ---------------------------------------------------------------------------------


def _tls_of(listener: dict[str, Any]) -> dict[str, Any] | None:
    socket = listener["filter_chains"][0].get("transport_socket")
    return None if socket is None else socket["typed_config"]


def test_mesh_listeners_demand_client_certificates_and_the_edge_serves_tls() -> None:
    listeners = {lst["name"]: lst for lst in render_resources(_spec(), Path("/tmp")).listeners}
    edge = _tls_of(listeners["edge"])
    assert edge is not None and not edge.get("require_client_certificate", False)
    assert edge["common_tls_context"]["tls_certificate_sds_secret_configs"][0]["name"] == "edge"
    for zone in ("zone-a", "zone-b"):
        mesh = _tls_of(listeners[f"mesh-{zone}"])
        assert mesh is not None and mesh["require_client_certificate"] is True
        context = mesh["common_tls_context"]
        assert context["alpn_protocols"] == ["h2"]
        assert context["validation_context_sds_secret_config"]["name"] == "mesh-trust"


def test_every_cluster_dials_mtls_and_accepts_only_its_service_kind() -> None:
    # Envoy's own admin socket and the trace collector are not mesh services.
    skipped = (ENVOY_ADMIN_CLUSTER, TRACE_COLLECTOR_CLUSTER)
    clusters = render_resources(_spec(), Path("/tmp")).clusters
    for cluster in (c for c in clusters if c["name"] not in skipped):
        context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
        assert context["tls_certificate_sds_secret_configs"][0]["name"] == "envoy"
        matcher = context["combined_validation_context"]["default_validation_context"]
        prefix = matcher["match_typed_subject_alt_names"][0]["matcher"]["prefix"]
        name = cluster["name"]
        kind = name if name in (GATEWAY_CLUSTER, REGISTRY_CLUSTER) else None
        kind = kind or ("gateway" if name == "gateway-streams" else None)
        kind = kind or ("feature" if name.startswith("feature") else "model")
        assert prefix == f"spiffe://servemesh/{kind}-", cluster["name"]


def test_a_plaintext_edge_keeps_mtls_inside(tmp_path: Path) -> None:
    spec = _spec(tls=TlsSpec(edge=False))
    listeners = {lst["name"]: lst for lst in render_resources(spec, tmp_path).listeners}
    assert _tls_of(listeners["edge"]) is None
    # Every listener but the edge is mutual TLS (the stats listener serves metrics only).
    inside = {n: lst for n, lst in listeners.items() if n not in ("edge", ENVOY_STATS_LISTENER)}
    assert inside and all(_tls_of(lst) is not None for lst in inside.values())
    _validate(spec, tmp_path)


# --- forced traces -----------------------------------------------------------------------


def test_a_sampled_traceparent_has_a_budget_at_the_edge() -> None:
    tracing = TracingSpec(
        forced_traces_per_second=30,
        forced_traces_burst=60,
        forced_traces_per_caller_per_second=4,
        forced_traces_per_caller_burst=8,
    )
    # Independent of the edge's own rate limit, and after auth (only admitted calls spend it).
    spec = _spec(
        tracing=tracing,
        traffic=TrafficSpec(
            rate_limit=RateLimit(enabled=False), edge_auth=EdgeAuth(enabled=True, users=[_USER])
        ),
    )
    hcm = _hcms(spec)["edge"]
    names = _filter_names(hcm)
    assert names.index("envoy.filters.http.basic_auth") < names.index(FORCED_TRACES_FILTER)
    [listener_level] = [f for f in hcm["http_filters"] if f["name"] == FORCED_TRACES_FILTER]
    assert set(listener_level["typed_config"]) == {"@type", "stat_prefix"}  # no bucket: inert
    # Every edge route (health Check, the streams, the catch-all) has a twin just before it.
    routes = _routes(spec, "edge")
    plain = [r for r in routes if not r["name"].endswith("-forced-trace")]
    assert [r["name"] for r in plain] == [
        "health",
        "rest-json",
        *(r["name"] for r in plain if r["name"].startswith("stream-")),
        "gateway",
    ]
    assert len(routes) == 2 * len(plain)
    for twin, route in zip(routes[::2], routes[1::2], strict=True):
        assert twin["name"] == f"{route['name']}-forced-trace"
        assert twin["route"] == route["route"]
        # The route's own header matchers (the JSON route's content type), then the twin's.
        *own, header = twin["match"].pop("headers")
        assert own == route["match"].get("headers", [])
        assert twin["match"] == {k: v for k, v in route["match"].items() if k != "headers"}
        assert header["name"] == "traceparent"
        budget = twin["typed_per_filter_config"].pop(FORCED_TRACES_FILTER)
        assert twin["typed_per_filter_config"] == route.get("typed_per_filter_config", {})
        assert budget["token_bucket"] == {
            "max_tokens": 60,
            "tokens_per_fill": 3,
            "fill_interval": "0.100s",
        }
        [per_caller] = budget["descriptors"]
        assert per_caller["entries"] == [{"key": "remote_address", "value": ""}]
        assert per_caller["token_bucket"] == {
            "max_tokens": 8,
            "tokens_per_fill": 4,
            "fill_interval": "1s",
        }
        assert budget["rate_limits"] == [{"actions": [{"remote_address": {}}]}]
        assert budget["rate_limited_as_resource_exhausted"] is True
        assert budget["always_consume_default_token_bucket"] is True
    # What the twin's header matcher takes: what Envoy's tracer reads as sampled (any case,
    # any version, the first of several headers joined by commas), never an unsampled one.
    sampled = re.compile(header["string_match"]["safe_regex"]["regex"])
    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    for value in (
        f"00-{tid}-{sid}-01",
        f"00-{tid.upper()}-{sid}-0B",
        f"7f-{tid}-{sid}-ff",
        f"00-{tid}-{sid}-01,00-{tid}-{sid}-00",
    ):
        assert sampled.match(value), value
    for value in (
        f"00-{tid}-{sid}-00",
        f"00-{tid}-{sid}-02",
        f"00-{tid}-{sid}-00,00-{tid}-{sid}-01",
    ):
        assert not sampled.match(value), value


def test_without_tracing_the_edge_has_no_forced_trace_budget() -> None:
    spec = _spec(tracing=TracingSpec(enabled=False))
    assert FORCED_TRACES_FILTER not in _filter_names(_hcms(spec)["edge"])
    assert not [r for r in _routes(spec, "edge") if r["name"].endswith("-forced-trace")]
