"""Render Envoy's configuration from the mesh spec.

Listeners, one per role: the edge listener is what clients call (it fronts the gateways);
each zone has a mesh listener for service-to-service calls made from that zone, whose
clusters put the zone's own endpoints at priority 0 and the other zones' at priority 1, so
Envoy fails over across zones and comes back when the local zone recovers.

Routes, clusters and endpoints are rendered as xDS resources. `servemesh up` serves them to
Envoy from files it watches (RDS/CDS/EDS over `path_config_source`), so a weight change is a
file swap, not a restart; `static_bootstrap` inlines the same resources into one file that
`envoy --mode validate` checks before anything is swapped. With `discovery.backend: dns`
there are no endpoint files: each service cluster is a STRICT_DNS cluster whose host names
(ResolvedSpec.endpoint_of) Envoy resolves itself, its endpoints inline in the cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2

from servemesh.contract.wire import (
    BUCKET_HEADER,
    BUCKET_RANGE_HEADER,
    CALLER_HEADER,
    CALLER_ROLE_HEADER,
    CONTROL_METHODS,
    ENVOY_ADMIN_CLUSTER,
    ENVOY_STATS_LISTENER,
    ENVOY_STATS_PATH,
    FEATURE_SERVICE,
    GATEWAY_CLUSTER,
    GATEWAY_SERVICE,
    HEALTH_SERVICE,
    MODEL_HEADER,
    MODEL_INFER_METHOD,
    OIP_PREFIX,
    REFLECTION_METHODS,
    REGISTRY_CLUSTER,
    REGISTRY_SERVICE,
    RETRY_ELSEWHERE_HEADER,
    SHADOW_ROLE_HEADER,
    SHADOW_ROLE_PRIMARY,
    SHADOW_ROLE_SHADOW,
    TRACE_COLLECTOR_CLUSTER,
    VERSION_HEADER,
    bucket_ranges,
    fault_runtime_prefix,
    feature_cluster,
    mesh_route_config,
    method_path,
    method_prefix,
    model_cluster,
    model_servers_cluster,
    shadow_cluster,
    version_health_name,
    zone_of_cluster,
)
from servemesh.identity.tokens import (
    ROLE_CLAIM,
    SUBJECT_CLAIM,
    audience_of,
    issuer_of,
    jwks_path,
)
from servemesh.procs.netns import zone_source_address
from servemesh.proxy.admin import ADMIN_SOCKET_MODE, admin_socket_path
from servemesh.proxy.tls import downstream_tls, upstream_tls
from servemesh.proxy.tracing import (
    collector_cluster,
    collector_is_named,
    forced_traces_filter,
    hcm_tracing,
    tracer_runtime,
    with_forced_trace_routes,
)
from servemesh.proxy.transcoder import json_body_limit_filter, json_route, transcoder_filter
from servemesh.spec import (
    EDGE_PROXY,
    DiscoverySpec,
    Instance,
    MeshSpec,
    ModelSpec,
    ResolvedSpec,
    ServiceKind,
    is_edge_proxy,
)
from servemesh.spec.durations import duration_seconds
from servemesh.spec.policy import (
    GRPC_CODES,
    EdgeAuth,
    FaultPolicy,
    Overload,
    RateLimit,
    RetryPolicy,
    RoutePolicy,
)
from servemesh.state.paths import XdsLayout
from servemesh_api.feature.v1 import feature_pb2
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2
from servemesh_api.registry.v1 import registry_pb2

_T = "type.googleapis.com/envoy."
_HCM = _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = _T + "extensions.filters.http.router.v3.Router"
_FAULT = _T + "extensions.filters.http.fault.v3.HTTPFault"
_GRPC_STATS = _T + "extensions.filters.http.grpc_stats.v3.FilterConfig"
_RATE_LIMIT = _T + "extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
_BASIC_AUTH = _T + "extensions.filters.http.basic_auth.v3.BasicAuth"
_RBAC = _T + "extensions.filters.http.rbac.v3.RBAC"
_FIXED_HEAP = _T + "extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig"
_DOWNSTREAM_CONNECTIONS = (
    _T + "extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)
_FILTER_CONFIG = _T + "config.route.v3.FilterConfig"
_HTTP_OPTIONS = _T + "extensions.upstreams.http.v3.HttpProtocolOptions"
_HEADER_MUTATION = _T + "extensions.filters.http.header_mutation.v3.HeaderMutation"
_UPSTREAM_CODEC = _T + "extensions.filters.http.upstream_codec.v3.UpstreamCodec"
_FILE_LOG = _T + "extensions.access_loggers.file.v3.FileAccessLog"
_UUID_REQUEST_ID = _T + "extensions.request_id.uuid.v3.UuidRequestIdConfig"
_PREVIOUS_HOSTS = _T + "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
_PREVIOUS_PRIORITIES = (
    _T + "extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig"
)
CLUSTER_TYPE = _T + "config.cluster.v3.Cluster"
ENDPOINTS_TYPE = _T + "config.endpoint.v3.ClusterLoadAssignment"
ROUTES_TYPE = _T + "config.route.v3.RouteConfiguration"

# The gRPC services whose methods get per-method stats; any other path is counted in one
# bucket, so a caller inventing method names cannot grow Envoy's stats without bound.
_KNOWN_SERVICES = (
    gateway_pb2.DESCRIPTOR,
    feature_pb2.DESCRIPTOR,
    grpc_service_pb2.DESCRIPTOR,
    registry_pb2.DESCRIPTOR,
    health_pb2.DESCRIPTOR,
)
# Headers only the mesh itself sets. A caller's copy is removed on every virtual host, so
# it can neither mark a call as a shadow copy nor reach a service that trusts the header.
_MESH_SET_HEADERS = (SHADOW_ROLE_HEADER,)
# At the edge no x-servemesh-* header is the caller's to send: the gateway sets its own.
# The bucket header too: a caller choosing its bucket would choose its version.
_EDGE_REMOVED_HEADERS = (MODEL_HEADER, VERSION_HEADER, SHADOW_ROLE_HEADER, BUCKET_HEADER)

# One JSON object per request: enough to follow a request id through every listener.
_ACCESS_LOG_FORMAT = {
    "start": "%START_TIME%",
    "path": "%REQ(:PATH)%",
    "grpc_status": "%GRPC_STATUS_NUMBER%",
    "flags": "%RESPONSE_FLAGS%",
    "ms": "%DURATION%",
    "cluster": "%UPSTREAM_CLUSTER%",
    "upstream": "%UPSTREAM_HOST%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "version": "%REQ(X-SERVEMESH-MODEL-VERSION)%",
    # Where a call's time went, µs: Envoy's own before the first byte went upstream, the
    # upstream's (last request byte sent to first answer byte), and Envoy's own after the
    # answer's last byte came back. "-" when the call never went upstream.
    "envoy_in_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "upstream_us": "%COMMON_DURATION(US_TX_END:US_RX_BEG:us)%",
    "envoy_out_us": "%COMMON_DURATION(US_RX_END:DS_TX_END:us)%",
}


# --- small builders ----------------------------------------------------------------------


def _ms(value: int | float) -> str:
    return f"{value / 1000:.3f}s"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _set_header(key: str, value: str) -> dict[str, Any]:
    return {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


def _percent(value: float) -> dict[str, Any]:
    return {"numerator": int(round(value)), "denominator": "HUNDRED"}


def _policy_for(spec: MeshSpec, model: ModelSpec | None) -> RoutePolicy:
    return (model.policy if model and model.policy else None) or spec.traffic.model


@dataclass(frozen=True)
class EndpointSet:
    """Who a cluster's endpoints are: every instance of one service kind, the caller's
    zone first (None: no zone is preferred)."""

    kind: ServiceKind
    local_zone: str | None


@dataclass(frozen=True)
class EnvoyResources:
    """Everything Envoy is told, as xDS resources plus the static parts of the bootstrap."""

    listeners: list[dict[str, Any]]
    route_configs: dict[str, dict[str, Any]]
    clusters: list[dict[str, Any]]
    load_assignments: dict[str, dict[str, Any]]
    # The clusters whose endpoints are service instances (a catalog may supply them).
    endpoint_sets: dict[str, EndpointSet] = field(default_factory=dict)


# --- clusters and endpoints --------------------------------------------------------------


@dataclass(frozen=True)
class ZoneEndpoint:
    """One endpoint of a cluster: an instance's address and port, and its zone."""

    zone: str
    address: str
    port: int
    # Told to Envoy as EDS health DRAINING: no new calls, calls in flight finish (a rolling
    # update's replica on its way out).
    draining: bool = False


def _lb_endpoint(member: ZoneEndpoint) -> dict[str, Any]:
    endpoint: dict[str, Any] = {"endpoint": {"address": _address(member.address, member.port)}}
    if member.draining:
        endpoint["health_status"] = "DRAINING"
    return endpoint


def load_assignment(
    name: str, members: Iterable[ZoneEndpoint], local_zone: str | None
) -> dict[str, Any]:
    """One locality per zone; the caller's zone at priority 0, the others at priority 1."""
    by_zone: dict[str, list[ZoneEndpoint]] = {}
    for member in members:
        by_zone.setdefault(member.zone, []).append(member)
    endpoints = []
    for zone, zone_members in sorted(by_zone.items()):
        endpoints.append(
            {
                "locality": {"zone": zone},
                "priority": 0 if local_zone is None or zone == local_zone else 1,
                "lb_endpoints": [_lb_endpoint(m) for m in zone_members],
            }
        )
    return {"cluster_name": name, "endpoints": endpoints}


def _load_assignment(
    spec: ResolvedSpec, name: str, members: list[Instance], local_zone: str | None
) -> dict[str, Any]:
    """The cluster's endpoints as the spec places its instances (the file catalog), or with
    `discovery.backend: dns` the host names Envoy resolves: instances that share a name and
    port are one endpoint, every address the name gives a host."""
    # A standby replica (the scaler's, not yet or not now in rotation) is told DRAINING too.
    draining = set(spec.fleet.draining) | set(spec.fleet.standby)
    endpoints: dict[tuple[str, int], ZoneEndpoint] = {}
    for member in members:
        address, port = spec.endpoint_of(member.name)
        before = endpoints.get((address, port))
        # A shared name drains only when every instance behind it does.
        out = member.name in draining and (before is None or before.draining)
        endpoints[(address, port)] = ZoneEndpoint(
            before.zone if before else member.zone, address, port, draining=out
        )
    return load_assignment(name, endpoints.values(), local_zone)


# Envoy's strict-DNS cluster: every address a name resolves to is a host of the cluster,
# resolved again every refresh (the typed form; Cluster.dns_refresh_rate is deprecated).
_DNS_CLUSTER = _T + "extensions.clusters.dns.v3.DnsCluster"


def _dns_cluster_type(discovery: DiscoverySpec) -> dict[str, Any]:
    """`cluster_type` of a cluster whose endpoints are host names (discovery.backend dns)."""
    return {
        "name": "envoy.cluster.dns",
        "typed_config": {
            "@type": _DNS_CLUSTER,
            "dns_refresh_rate": _ms(discovery.dns_refresh_rate_ms),
            "respect_dns_ttl": discovery.respect_dns_ttl,
            "dns_lookup_family": discovery.dns_lookup_family.upper(),
            "all_addresses_in_single_endpoint": False,
        },
    }


def is_eds(cluster: dict[str, Any]) -> bool:
    """Whether a rendered cluster reads its endpoints from an endpoint file (EDS); with
    `discovery.backend: dns` none does: each carries its `load_assignment` inline."""
    return cluster.get("type") == "EDS"


def _inline_endpoints(cluster: dict[str, Any], assignment: dict[str, Any]) -> dict[str, Any]:
    """A cluster with its endpoints in it: a service's host names stay STRICT_DNS, the
    rest (Envoy's admin socket, the trace collector's address) becomes STATIC."""
    inline = {**cluster, "load_assignment": assignment}
    if is_eds(cluster):
        inline["type"] = "STATIC"
    return inline


def _shadow_marking(version: str) -> list[dict[str, Any]]:
    """Upstream filters of a shadow cluster: the copy says it is a shadow, and of which
    version, whatever headers the primary call carried."""
    mutations = [
        {"append": _set_header(VERSION_HEADER, version)},
        {"append": _set_header(SHADOW_ROLE_HEADER, SHADOW_ROLE_SHADOW)},
    ]
    return [
        {
            "name": "envoy.filters.http.header_mutation",
            "typed_config": {
                "@type": _HEADER_MUTATION,
                "mutations": {"request_mutations": mutations},
            },
        },
        {"name": "envoy.filters.http.upstream_codec", "typed_config": {"@type": _UPSTREAM_CODEC}},
    ]


def _cluster(
    name: str,
    policy: RoutePolicy,
    eds: bool,
    upstream_filters: list[dict[str, Any]] | None = None,
    health_name: str = "",
) -> dict[str, Any]:
    """A gRPC upstream cluster: HTTP/2, active gRPC health checks, breakers, ejection.

    `health_name` is the gRPC health service the checks ask about ("" is the replica's
    overall health); a model version's cluster asks for that version's own status, so a
    replica counts as a host of the version only while it holds it."""
    health = policy.health_checks
    breakers = policy.circuit_breakers
    cluster: dict[str, Any] = {
        "name": name,
        "connect_timeout": "0.25s",
        # Least-request keeps a slow (or batching-busy) replica from receiving an equal share.
        "lb_policy": "LEAST_REQUEST",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": {
                    "http2_protocol_options": {"max_concurrent_streams": 1024}
                },
            }
        },
        "health_checks": [
            {
                "timeout": _ms(health.timeout_ms),
                "interval": _ms(health.interval_ms),
                "no_traffic_interval": _ms(health.no_traffic_interval_ms),
                "unhealthy_threshold": health.unhealthy_threshold,
                "healthy_threshold": health.healthy_threshold,
                "grpc_health_check": {"service_name": health_name} if health_name else {},
            }
        ],
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": breakers.max_connections,
                    "max_pending_requests": breakers.max_pending_requests,
                    "max_requests": breakers.max_requests,
                    "retry_budget": {
                        "budget_percent": {"value": policy.retries.budget_percent},
                        "min_retry_concurrency": policy.retries.min_retry_concurrency,
                    },
                }
            ]
        },
        # Priority 1 (the other zones) takes traffic only as priority 0 loses health.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0.0}},
    }
    outlier = policy.outlier_detection
    if outlier.enabled:
        cluster["outlier_detection"] = {
            "consecutive_5xx": outlier.consecutive_5xx,
            "consecutive_gateway_failure": outlier.consecutive_gateway_failure,
            "interval": _ms(outlier.interval_ms),
            "base_ejection_time": _ms(outlier.base_ejection_time_ms),
            "max_ejection_percent": outlier.max_ejection_percent,
            # By default one passing health check lets an ejected host back in, within the
            # second. A replica that answers Health but fails every call would then take a
            # few calls a second (masked by retries, but each a wasted try) instead of
            # sitting out base_ejection_time, longer each time it is ejected again.
            "successful_active_health_check_uneject_host": False,
        }
    if upstream_filters:
        options = cluster["typed_extension_protocol_options"]
        options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["http_filters"] = (
            upstream_filters
        )
    cluster["type"] = "EDS" if eds else "STATIC"
    return cluster


# --- routes ------------------------------------------------------------------------------


# How many times a retry's host pick may be redrawn while it lands on a host already tried.
# Least-request favours a host that fails fast (it holds no requests): with two gateways
# and zone-a's failing at once because its Envoy was killed, each pick chose it again 3
# times in 4, and with 3 redraws a call's every try went to it (one call of a drill's 54).
# Twenty redraws leave that at 0.75^20, 0.3%; a redraw is one load-balancer pick.
HOST_RESELECTIONS = 20


def _retry_policy(policy: RetryPolicy) -> dict[str, Any]:
    retry: dict[str, Any] = {
        "retry_on": ",".join(policy.retry_on),
        "num_retries": policy.num_retries,
        "retry_back_off": {
            "base_interval": _ms(policy.backoff_base_ms),
            "max_interval": _ms(policy.backoff_max_ms),
        },
    }
    if policy.per_try_timeout_ms:
        retry["per_try_timeout"] = _ms(policy.per_try_timeout_ms)
    if policy.previous_hosts:
        retry["retry_host_predicate"] = [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _PREVIOUS_HOSTS},
            }
        ]
        retry["host_selection_retry_max_attempts"] = HOST_RESELECTIONS
    if policy.previous_priorities:
        # Once a try in the local zone failed, the next goes to the other zone.
        retry["retry_priority"] = {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {"@type": _PREVIOUS_PRIORITIES, "update_frequency": 1},
        }
    return retry


def _route_action(policy: RoutePolicy, retries: bool = True) -> dict[str, Any]:
    """Settings every gRPC route shares: the caller's grpc-timeout is the deadline."""
    action: dict[str, Any] = {
        "timeout": _ms(policy.timeout_ms),
        "max_stream_duration": {
            "grpc_timeout_header_max": _ms(policy.grpc_timeout_header_max_ms),
            "max_stream_duration": _ms(policy.max_stream_duration_ms),
        },
    }
    if retries:
        action["retry_policy"] = _retry_policy(policy.retries)
        if policy.retries.hedge_on_per_try_timeout:
            action["hedge_policy"] = {"hedge_on_per_try_timeout": True}
    return action


def _fault_config(route: str, fault: FaultPolicy) -> dict[str, Any]:
    """Fault filter settings for one route, every number overridable through runtime keys."""
    prefix = fault_runtime_prefix(route)
    return {
        "@type": _FAULT,
        "delay": {
            # Envoy needs a positive delay here; the runtime key (ms) overrides it.
            "fixed_delay": _ms(max(fault.delay_ms, 1)),
            "percentage": _percent(fault.delay_percent),
        },
        "abort": {
            "grpc_status": GRPC_CODES[fault.abort_status],
            "percentage": _percent(fault.abort_percent),
        },
        "delay_percent_runtime": f"{prefix}.delay_percent",
        "delay_duration_runtime": f"{prefix}.delay_ms",
        "abort_percent_runtime": f"{prefix}.abort_percent",
        "abort_grpc_status_runtime": f"{prefix}.abort_grpc_status",
    }


def _with_fault(route: dict[str, Any], name: str, fault: FaultPolicy) -> dict[str, Any]:
    route["typed_per_filter_config"] = {"envoy.filters.http.fault": _fault_config(name, fault)}
    return route


def _model_routes(
    spec: MeshSpec, model_name: str, model: ModelSpec, zone: str
) -> list[dict[str, Any]]:
    policy = _policy_for(spec, model)
    model_match = {"name": MODEL_HEADER, "string_match": {"exact": model_name}}
    fault_name = f"model.{model_name}"
    routes: list[dict[str, Any]] = []
    # Every model route names the version it picked in a response header, so the gateway
    # counts a failed call against the version that failed (the replica's error names
    # none). A reply Envoy makes before routing (the fault filter's abort) carries none,
    # and its failure counts under no version.
    # A pinned version goes straight to its cluster.
    for version in sorted(model.versions):
        route = {
            "name": f"{model_name}-{version}-pinned",
            "match": {
                "prefix": OIP_PREFIX,
                "headers": [
                    model_match,
                    {"name": VERSION_HEADER, "string_match": {"exact": version}},
                ],
            },
            "route": {"cluster": model_cluster(model_name, version, zone), **_route_action(policy)},
            "response_headers_to_add": [_set_header(VERSION_HEADER, version)],
        }
        routes.append(_with_fault(route, fault_name, policy.fault))
    mirrors: list[dict[str, Any]] = []
    primary: list[dict[str, Any]] = []
    if model.shadow is not None:
        # Envoy sends a copy to the shadow cluster and discards its answer. The primary
        # call is marked so its replica records what it answered; the shadow cluster
        # re-marks the copy (role and version) on its way out, and that replica records too.
        mirrors = [
            {
                "cluster": shadow_cluster(model_name, model.shadow.version, zone),
                "runtime_fraction": {
                    "default_value": _percent(model.shadow.percent),
                    "runtime_key": f"shadow.{model_name}.percent",
                },
            }
        ]
        primary = [_set_header(SHADOW_ROLE_HEADER, SHADOW_ROLE_PRIMARY)]
    # Sticky: the gateway's bucket header (a hash of the call's first entity) picks the
    # version by range, so each entity keeps its version and the split is exact. One
    # cluster per route keeps retries within the version, as the weighted split does.
    for version, (start, end) in bucket_ranges(model.traffic).items():
        action: dict[str, Any] = {
            "cluster": model_cluster(model_name, version, zone),
            **_route_action(policy),
        }
        if mirrors:
            action["request_mirror_policies"] = mirrors
        route = {
            "name": f"{model_name}-{version}-bucket",
            "match": {
                "prefix": OIP_PREFIX,
                "headers": [
                    model_match,
                    {"name": BUCKET_HEADER, "range_match": {"start": start, "end": end}},
                ],
            },
            "route": action,
            "request_headers_to_add": [*primary, _set_header(VERSION_HEADER, version)],
            # The answer names the range (and the mirror): a gateway that shared one call
            # among several callers checks they all belonged here.
            "response_headers_to_add": [
                *primary,
                _set_header(VERSION_HEADER, version),
                _set_header(BUCKET_RANGE_HEADER, f"{start}-{end}"),
            ],
        }
        routes.append(_with_fault(route, fault_name, policy.fault))
    # Without a bucket (no entity; a caller inside the mesh): the traffic split picks the
    # version and tells the replica which one.
    split_action: dict[str, Any] = {
        "weighted_clusters": {
            "clusters": [
                {
                    "name": model_cluster(model_name, version, zone),
                    "weight": weight,
                    "request_headers_to_add": [_set_header(VERSION_HEADER, version)],
                    "response_headers_to_add": [_set_header(VERSION_HEADER, version)],
                }
                for version, weight in sorted(model.traffic.items())
            ]
        },
        **_route_action(policy),
    }
    if mirrors:
        split_action["request_mirror_policies"] = mirrors
    split: dict[str, Any] = {
        "name": f"{model_name}-split",
        "match": {"prefix": OIP_PREFIX, "headers": [model_match]},
        "route": split_action,
    }
    if primary:
        split["request_headers_to_add"] = primary
    routes.append(_with_fault(split, fault_name, policy.fault))
    return routes


def _mesh_routes(spec: MeshSpec, zone: str) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = []
    for model_name, model in sorted(spec.models.items()):
        routes += _model_routes(spec, model_name, model, zone)
    feature = spec.traffic.feature
    routes.append(
        _with_fault(
            {
                "name": "feature",
                "match": {"prefix": method_prefix(FEATURE_SERVICE)},
                "route": {"cluster": feature_cluster(zone), **_route_action(feature)},
            },
            "feature",
            feature.fault,
        )
    )
    routes += [
        {
            "name": "registry",
            "match": {"prefix": method_prefix(REGISTRY_SERVICE)},
            # Uploads are not idempotent mid-stream: no retries.
            "route": {
                "cluster": REGISTRY_CLUSTER,
                **_route_action(spec.traffic.model, retries=False),
            },
        },
        # OIP calls without a model header (tritonclient, grpcurl): any model server.
        {
            "name": "model-servers",
            "match": {"prefix": OIP_PREFIX},
            "route": {"cluster": model_servers_cluster(zone), **_route_action(spec.traffic.model)},
        },
    ]
    return routes


def _edge_routes(spec: MeshSpec) -> list[dict[str, Any]]:
    edge = spec.traffic.edge
    open_health = {
        "name": "health",
        # Exactly the unary Check: Watch (a stream a caller can hold open) needs credentials.
        "match": {"path": method_path(HEALTH_SERVICE, "Check")},
        "route": {"cluster": GATEWAY_CLUSTER, **_route_action(edge)},
        # Load balancers and probes check health without credentials.
        "typed_per_filter_config": _edge_auth_disabled(spec.traffic.edge_auth),
    }
    to_gateways = {"cluster": GATEWAY_CLUSTER, **_route_action(edge)}
    if spec.proxy.layout == "per_zone":
        # A gateway whose zone's Envoy is down says so in a header (it reached nothing
        # downstream): the call is tried again on another gateway (previous_hosts), within
        # the edge's retries and their budget.
        retry = to_gateways["retry_policy"]
        retry["retry_on"] = ",".join([*retry["retry_on"].split(","), "retriable-headers"])
        retry["retriable_headers"] = [{"name": RETRY_ELSEWHERE_HEADER, "present_match": True}]
    routes = [
        *([open_health] if spec.traffic.edge_auth.active_mode != "off" else []),
        json_route(spec, copy.deepcopy(to_gateways)),
        *_stream_routes(spec),
        *_hedged_routes(spec, to_gateways),
        _with_fault(
            {
                "name": "gateway",
                "match": {"prefix": "/"},
                "route": to_gateways,
            },
            "edge",
            edge.fault,
        ),
    ]
    # A sampled traceparent forces a trace on any of them (Envoy decides before any
    # filter runs): each has a twin for such calls, held to the forced-trace budget.
    return with_forced_trace_routes(spec, routes)


# The idempotent reads a caller makes at the edge: the only calls the edge may hedge.
HEDGED_EDGE_METHODS = (method_path(GATEWAY_SERVICE, "Predict"), MODEL_INFER_METHOD)


def _hedged_routes(spec: MeshSpec, to_gateways: dict[str, Any]) -> list[dict[str, Any]]:
    """With traffic.edge_hedge on, a route per hedged method: the gateways' route, with a
    second gateway asked once the first has held the call `after_ms` (previous_hosts sends
    the hedge to another gateway). Envoy sends both the caller's whole deadline, not the
    hedge delay. The edge's fault settings apply here as on the catch-all route."""
    after_ms = spec.traffic.edge_hedge.after_ms
    if not after_ms:
        return []
    routes = []
    for path in HEDGED_EDGE_METHODS:
        action = copy.deepcopy(to_gateways)
        action["retry_policy"]["per_try_timeout"] = _ms(after_ms)
        action["hedge_policy"] = {"hedge_on_per_try_timeout": True}
        name = "hedged-" + path.rsplit("/", 1)[-1]
        route = {"name": name, "match": {"path": path}, "route": action}
        routes.append(_with_fault(route, "edge", spec.traffic.edge.fault))
    return routes


# --- edge limits -------------------------------------------------------------------------

# The gateways again, for the calls a caller can hold open: a breaker of their own, so
# held streams never fill the one Predicts go through.
GATEWAY_STREAMS_CLUSTER = "gateway-streams"
# The methods at the edge whose calls stay open as long as the caller likes.
LONG_LIVED_METHODS = (
    method_path(HEALTH_SERVICE, "Watch"),
    *REFLECTION_METHODS,
)
_LISTENER_CONNECTION_LIMIT = "envoy.resource_limits.listener.{}.connection_limit"


def _streams_policy(spec: MeshSpec) -> RoutePolicy:
    """The edge policy with the streams' own, small breaker."""
    edge = spec.traffic.edge
    most = spec.traffic.edge_streams.max_streams
    breakers = edge.circuit_breakers.model_copy(
        update={
            "max_requests": most,
            "max_pending_requests": min(most, edge.circuit_breakers.max_pending_requests),
        }
    )
    return edge.model_copy(update={"circuit_breakers": breakers})


def _stream_routes(spec: MeshSpec) -> list[dict[str, Any]]:
    """One route per long-lived method: to the streams cluster, never retried (a stream
    that started is not idempotent), ended after max_stream_duration_ms whatever deadline
    the caller asked for."""
    duration = _ms(spec.traffic.edge_streams.max_stream_duration_ms)
    return [
        {
            "name": f"stream-{path.rsplit('/', 2)[-2]}",
            "match": {"path": path},
            "route": {
                "cluster": GATEWAY_STREAMS_CLUSTER,
                "timeout": "0s",
                "max_stream_duration": {
                    "max_stream_duration": duration,
                    "grpc_timeout_header_max": duration,
                },
            },
        }
        for path in LONG_LIVED_METHODS
    ]


def listener_connection_limits(spec: MeshSpec) -> dict[str, int]:
    """Runtime keys capping each listener's open connections (Envoy closes a connection
    past its listener's cap at accept, before any TLS work)."""
    limits = spec.traffic.connections
    caps = {"edge": limits.edge_max_connections, ENVOY_STATS_LISTENER: limits.stats_max_connections}
    for zone in spec.zones:
        caps[mesh_route_config(zone)] = limits.mesh_max_connections
    return {_LISTENER_CONNECTION_LIMIT.format(name): cap for name, cap in caps.items()}


def _hcm_limits(spec: MeshSpec, edge: bool) -> dict[str, Any]:
    """A connection manager's bounds on one client connection."""
    limits = spec.traffic.connections
    streams = limits.edge_max_concurrent_streams if edge else limits.mesh_max_concurrent_streams
    return {
        "request_headers_timeout": _ms(limits.request_headers_timeout_ms),
        "http2_protocol_options": {"max_concurrent_streams": streams},
    }


def _chain_limits(spec: MeshSpec, chain: dict[str, Any]) -> dict[str, Any]:
    """A TLS filter chain closes a connection whose handshake is not done in time."""
    if "transport_socket" not in chain:
        return chain
    timeout = _ms(spec.traffic.connections.tls_handshake_timeout_ms)
    return {**chain, "transport_socket_connect_timeout": timeout}


# --- listeners ---------------------------------------------------------------------------

# A documentation-only address (TEST-NET-1): the one "internal" range, which no caller has.
# Named explicitly because Envoy's default has changed across versions (older ones treat
# loopback and private ranges as internal, and would obey a local caller's x-envoy-*).
_NOBODY = {"address_prefix": "192.0.2.0", "prefix_len": 32}


def _basic_auth_filter(auth: EdgeAuth) -> dict[str, Any]:
    if not auth.users:
        raise ValueError("traffic.edge_auth.users: empty (servemesh up fills it in)")
    return {
        "name": _BASIC_AUTH_FILTER,
        "typed_config": {
            "@type": _BASIC_AUTH,
            "users": {"inline_string": "\n".join(auth.users)},
            # The verified user name is the caller (the per-caller rate limit's key).
            "forward_username_header": CALLER_HEADER,
        },
    }


# --- edge auth (traffic.edge_auth) -------------------------------------------------------

_BASIC_AUTH_FILTER = "envoy.filters.http.basic_auth"
_JWT_AUTHN_FILTER = "envoy.filters.http.jwt_authn"
_JWT_AUTHN = _T + "extensions.filters.http.jwt_authn.v3.JwtAuthentication"
_JWT_PROVIDER = "mesh"
# Headers the edge's auth sets for the gateway: a caller's own copies are removed by the
# first auth filter, so only what Envoy verified reaches a gateway. (The virtual host's
# request_headers_to_remove would come too late: the router applies it after every HTTP
# filter, so it would remove what jwt_authn set, not only what the caller sent.)
_CALLER_HEADERS = (CALLER_ROLE_HEADER, CALLER_HEADER)
# Verified tokens the edge keeps per worker thread: callers hold one token at a time and
# sign a new one as it nears expiry, so this covers hundreds of callers (a few KiB each).
JWT_CACHE_SIZE = 1024


def _caller_headers_removed() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _HEADER_MUTATION,
            "mutations": {"request_mutations": [{"remove": h} for h in _CALLER_HEADERS]},
        },
    }


def _jwt_authn_filter(spec: MeshSpec) -> dict[str, Any]:
    """Every call but the open health check needs a bearer token the mesh's key signed,
    for this mesh's issuer and audience, with an expiry; its `role` and `sub` claims go on
    to the gateway. The JWKS is the public half of `<state_dir>/auth/signing-key.pem`."""
    auth = spec.traffic.edge_auth
    provider = {
        "issuer": issuer_of(auth, spec.name),
        "audiences": [audience_of(auth, spec.name)],
        "local_jwks": {"filename": str(jwks_path(spec.state_dir))},
        "require_expiration": True,
        "max_lifetime": f"{int(duration_seconds(auth.max_token_ttl))}s",
        "clock_skew_seconds": 30,
        # The token stops at the edge: the gateway gets what it said, not the token.
        "forward": False,
        # A verified token is kept (per worker thread, least recently used out first) and
        # its signature not checked again: an ES256 check cost the edge about 70 µs of
        # CPU per call, as much as the rest of its pass (docs/benchmarks.md, "Edge auth's
        # cost"). A kept token is still dropped at its expiry; a bad one is never kept.
        "jwt_cache_config": {"jwt_cache_size": JWT_CACHE_SIZE},
        "claim_to_headers": [
            {"header_name": CALLER_ROLE_HEADER, "claim_name": ROLE_CLAIM},
            {"header_name": CALLER_HEADER, "claim_name": SUBJECT_CLAIM},
        ],
    }
    return {
        "name": _JWT_AUTHN_FILTER,
        "typed_config": {
            "@type": _JWT_AUTHN,
            "providers": {_JWT_PROVIDER: provider},
            "rules": [{"match": {"prefix": "/"}, "requires": {"provider_name": _JWT_PROVIDER}}],
        },
    }


def _edge_auth_filters(spec: MeshSpec) -> list[dict[str, Any]]:
    """The edge's auth filters, in order: a caller's caller headers removed, then the mode's
    check (none with mode off: the headers are still removed)."""
    mode = spec.traffic.edge_auth.active_mode
    filters = [_caller_headers_removed()]
    if mode == "basic":
        filters.append(_basic_auth_filter(spec.traffic.edge_auth))
    elif mode == "jwt":
        filters.append(_jwt_authn_filter(spec))
    return filters


def _client_cert_forwarding(spec: MeshSpec, edge: bool) -> dict[str, Any]:
    """At a TLS edge, the caller's verified client certificate (optional, from the mesh CA)
    goes on to the gateway as x-forwarded-client-cert with its URI (SPIFFE id); a caller's
    own header is replaced, never passed on. Elsewhere Envoy's default removes it."""
    if not (edge and spec.tls.edge):
        return {}
    return {
        "forward_client_cert_details": "SANITIZE_SET",
        "set_current_client_cert_details": {"uri": True},
    }


def _edge_auth_disabled(auth: EdgeAuth) -> dict[str, Any]:
    """A route's per-filter config that lets it through without credentials."""
    name = _JWT_AUTHN_FILTER if auth.active_mode == "jwt" else _BASIC_AUTH_FILTER
    return {name: {"@type": _FILTER_CONFIG, "disabled": True}}


def _control_calls_denied() -> dict[str, Any]:
    """Control calls (registry writes, model loads and unloads, feature writes) are never
    proxied: anyone who can reach a listener could otherwise change what the mesh serves.
    gRPC callers get PERMISSION_DENIED; operators reach the services directly."""
    return {
        "name": "envoy.filters.http.rbac",
        "typed_config": {
            "@type": _RBAC,
            "rules": {
                "action": "DENY",
                "policies": {
                    "control-calls": {
                        "permissions": [
                            {"url_path": {"path": {"exact": path}}}
                            for path in sorted(CONTROL_METHODS)
                        ],
                        "principals": [{"any": True}],
                    }
                },
            },
        },
    }


def _known_methods() -> list[dict[str, Any]]:
    services = []
    for file in _KNOWN_SERVICES:
        for service in file.services_by_name.values():
            services.append(
                {
                    "name": service.full_name,
                    "method_names": sorted(m.name for m in service.methods),
                }
            )
    return sorted(services, key=lambda s: str(s["name"]))


def _token_bucket(requests_per_second: int, burst: int) -> dict[str, Any]:
    # Ten fills a second; below 10 requests a second, one fill a second (a per-caller
    # bucket's interval must be a multiple of the overall bucket's 100 ms).
    if requests_per_second < 10:
        return {"max_tokens": burst, "tokens_per_fill": requests_per_second, "fill_interval": "1s"}
    return {
        "max_tokens": burst,
        "tokens_per_fill": requests_per_second // 10,
        "fill_interval": "0.100s",
    }


def _caller_rate_limit_filter(limit: RateLimit) -> dict[str, Any]:
    """After the edge's auth: a bucket per authenticated caller (the name the auth filter
    verified, CALLER_HEADER), the same size as an address's. Callers behind one address
    are then held apart by name, and one name is held to its bucket from any address. A
    call without the header (auth off, the open health check) has no descriptor here and
    passes (this filter has no bucket of its own)."""
    per_caller = _token_bucket(
        min(limit.per_caller_requests_per_second, limit.requests_per_second),
        min(limit.per_caller_burst, limit.burst),
    )
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": _RATE_LIMIT,
            "stat_prefix": "edge_caller_rate_limit",
            "rate_limits": [
                {
                    "actions": [
                        {
                            "request_headers": {
                                "header_name": CALLER_HEADER,
                                "descriptor_key": "caller",
                                "skip_if_absent": True,
                            }
                        }
                    ]
                }
            ],
            "descriptors": [
                {"entries": [{"key": "caller", "value": ""}], "token_bucket": per_caller}
            ],
            "max_dynamic_descriptors": limit.max_callers,
            "filter_enabled": {
                "runtime_key": "edge_rate_limit.enabled",
                "default_value": _percent(100),
            },
            "filter_enforced": {
                "runtime_key": "edge_rate_limit.enforced",
                "default_value": _percent(100),
            },
            "rate_limited_as_resource_exhausted": True,
        },
    }


def _rate_limit_filter(limit: RateLimit) -> dict[str, Any]:
    # One caller's bucket is never larger than the overall one.
    per_caller = _token_bucket(
        min(limit.per_caller_requests_per_second, limit.requests_per_second),
        min(limit.per_caller_burst, limit.burst),
    )
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": _RATE_LIMIT,
            "stat_prefix": "edge_rate_limit",
            # The overall bucket: every call takes a token from it too.
            "token_bucket": _token_bucket(limit.requests_per_second, limit.burst),
            # A bucket per caller address (an entry with an empty value is one bucket per
            # distinct value, up to max_dynamic_descriptors of them, least recent dropped).
            # The address is the peer's own: use_remote_address, no trusted forwarding.
            "rate_limits": [{"actions": [{"remote_address": {}}]}],
            "descriptors": [
                {
                    "entries": [{"key": "remote_address", "value": ""}],
                    "token_bucket": per_caller,
                }
            ],
            "max_dynamic_descriptors": limit.max_callers,
            "always_consume_default_token_bucket": True,
            "filter_enabled": {
                "runtime_key": "edge_rate_limit.enabled",
                "default_value": _percent(100),
            },
            "filter_enforced": {
                "runtime_key": "edge_rate_limit.enforced",
                "default_value": _percent(100),
            },
            # gRPC callers get RESOURCE_EXHAUSTED (shedding), not UNAVAILABLE.
            "rate_limited_as_resource_exhausted": True,
        },
    }


def _listener(
    name: str,
    spec: ResolvedSpec,
    port: int,
    route_config: str,
    log_dir: Path,
    extra_filters: list[dict[str, Any]],
    edge: bool,
    log_name: str = "",
) -> dict[str, Any]:
    chain: dict[str, Any] = {}
    if not edge or spec.tls.edge:
        # Mutual TLS on the mesh listeners always; TLS at the edge unless the spec turns it
        # off for local debugging.
        chain["transport_socket"] = downstream_tls(spec, edge=edge)
    filters = [
        *extra_filters,
        # Per-cluster gRPC counters by status (cluster.<name>.grpc.<service>.<method>.*), per
        # method only for the mesh's own methods, and each method's upstream time (the
        # scaler reads the edge's Predict time: servemesh/scaling/edge.py).
        {
            "name": "envoy.filters.http.grpc_stats",
            "typed_config": {
                "@type": _GRPC_STATS,
                "individual_method_stats_allowlist": {"services": _known_methods()},
                "enable_upstream_stats": True,
            },
        },
        # Inert until a route's percentages (or their runtime keys) are raised.
        {"name": "envoy.filters.http.fault", "typed_config": _fault_config(name, FaultPolicy())},
        {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
    ]
    return {
        "name": name,
        "address": _address(spec.listen_host, port),
        "filter_chains": [
            {
                **_chain_limits(spec, chain),
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": _HCM,
                            "stat_prefix": name,
                            # Services speak gRPC to the mesh listeners: HTTP/2 only there.
                            "codec_type": "AUTO" if edge else "HTTP2",
                            # The caller's address is the peer's, never a forwarded one, and
                            # no caller is internal (loopback included): Envoy then removes
                            # a caller's x-envoy-* control headers (retries, timeouts).
                            "use_remote_address": True,
                            "internal_address_config": {"cidr_ranges": [_NOBODY]},
                            "generate_request_id": True,
                            # The edge makes a fresh id for every request (a caller's id is
                            # not trusted: it would name another request in the logs); the
                            # mesh listeners keep the gateway's so one id follows a request.
                            "preserve_external_request_id": not edge,
                            # An id is a name, never a carrier: Envoy's tracer would
                            # otherwise rewrite a digit of it to mark its sampling choice,
                            # and the gateway's id would not match the mesh listener's.
                            "request_id_extension": {
                                "typed_config": {
                                    "@type": _UUID_REQUEST_ID,
                                    "pack_trace_reason": False,
                                    "use_request_id_for_trace_sampling": False,
                                }
                            },
                            # One spelling per path, so the control-call rule cannot be
                            # dodged with `//`, `.` segments or percent-encoding.
                            "normalize_path": True,
                            "merge_slashes": True,
                            "path_with_escaped_slashes_action": "REJECT_REQUEST",
                            **_hcm_limits(spec, edge),
                            "access_log": [
                                {
                                    "name": "envoy.access_loggers.file",
                                    "typed_config": {
                                        "@type": _FILE_LOG,
                                        "path": str(
                                            log_dir / f"envoy-{log_name or name}-access.log"
                                        ),
                                        "log_format": {"json_format": _ACCESS_LOG_FORMAT},
                                    },
                                }
                            ],
                            "rds": {"route_config_name": route_config},
                            "http_filters": filters,
                            **hcm_tracing(spec, name),
                            **_client_cert_forwarding(spec, edge),
                        },
                    }
                ],
            }
        ],
    }


# --- the whole configuration -------------------------------------------------------------


def render_resources(spec: ResolvedSpec, log_dir: Path, proxy: str = EDGE_PROXY) -> EnvoyResources:
    """Every listener, route configuration, cluster and endpoint set one of the mesh's
    Envoys (`proxy`, a name of spec.proxies()) serves: in the shared layout the one Envoy
    serves all of them; in the per-zone layout see `_held_by`."""
    everything = _render_all(spec, log_dir, proxy)
    if spec.proxy.layout == "shared":
        return everything
    return _held_by(spec, everything, proxy)


def render_proxies(spec: ResolvedSpec, log_dir: Path) -> dict[str, EnvoyResources]:
    """What each of the mesh's Envoys serves, by name (the edge's first)."""
    return {proxy: render_resources(spec, log_dir, proxy) for proxy in spec.proxies()}


def _held_by(spec: ResolvedSpec, everything: EnvoyResources, proxy: str) -> EnvoyResources:
    """The part of the whole mesh's resources one Envoy of the per-zone layout holds.

    An edge (each zone's with an edge per zone): the edge listener and the gateways'
    clusters, every edge alike but for its port, so any of them serves any caller. A zone:
    its mesh listener and the clusters its callers reach (those named for the zone, and the
    registry). Each has its own stats listener (rendered for it) and the trace collector."""
    if is_edge_proxy(proxy):
        routes = {"edge"}
        clusters = {GATEWAY_CLUSTER, GATEWAY_STREAMS_CLUSTER}
    elif proxy in spec.zones:
        routes = {mesh_route_config(proxy)}
        clusters = {
            c["name"] for c in everything.clusters if zone_of_cluster(c["name"]) == proxy
        } | {REGISTRY_CLUSTER}
    else:
        raise ValueError(f"no Envoy named {proxy!r}; Envoys: {spec.proxies()}")
    routes.add(ENVOY_STATS_LISTENER)
    clusters |= {ENVOY_ADMIN_CLUSTER, TRACE_COLLECTOR_CLUSTER}
    return EnvoyResources(
        listeners=[
            listener for listener in everything.listeners if _route_config_of(listener) in routes
        ],
        route_configs={k: v for k, v in everything.route_configs.items() if k in routes},
        clusters=[c for c in everything.clusters if c["name"] in clusters],
        load_assignments={k: v for k, v in everything.load_assignments.items() if k in clusters},
        endpoint_sets={k: v for k, v in everything.endpoint_sets.items() if k in clusters},
    )


def _route_config_of(listener: dict[str, Any]) -> str:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return str(hcm["rds"]["route_config_name"])


def _render_all(spec: ResolvedSpec, log_dir: Path, proxy: str) -> EnvoyResources:
    """Every resource of the mesh, the stats listener rendered for `proxy`."""
    instances = spec.instances()

    def of(service: str) -> list[Instance]:
        return [i for i in instances if i.service == service]

    clusters: list[dict[str, Any]] = []
    assignments: dict[str, dict[str, Any]] = {}
    endpoint_sets: dict[str, EndpointSet] = {}

    def add(
        name: str,
        kind: ServiceKind,
        members: list[Instance],
        policy: RoutePolicy,
        local_zone: str | None,
        upstream_filters: list[dict[str, Any]] | None = None,
        health_name: str = "",
    ) -> None:
        cluster = _cluster(
            name, policy, eds=True, upstream_filters=upstream_filters, health_name=health_name
        )
        # Every replica of a cluster is of one service kind; Envoy accepts only a
        # certificate naming an instance of that kind.
        cluster["transport_socket"] = upstream_tls(spec, kind)
        if kind != "registry":
            # A replica the endpoints stop listing (a blue-green switch of a version's
            # cluster to the new set, a retired set, one the scaler drained and stops)
            # leaves at once, its calls in flight finishing; by default Envoy would keep it
            # while it passes health checks.
            cluster["ignore_health_on_host_removal"] = True
        if (
            local_zone is not None
            and spec.network.mode == "netns"
            and spec.proxy.layout == "shared"
        ):
            # Zones in network namespaces, one Envoy on the machine for all: a zone's
            # clusters send from a loopback source of their own, which the namespaces see as
            # that zone's address, so a partition between two zones also cuts the calls
            # Envoy proxies for one to the other. (An Envoy per zone runs inside its zone
            # and sends from the zone's own address.)
            source = zone_source_address(spec.zones.index(local_zone))
            cluster["upstream_bind_config"] = {
                "source_address": {"address": source, "port_value": 0}
            }
        if spec.discovery.backend == "dns":
            del cluster["type"]
            cluster["cluster_type"] = _dns_cluster_type(spec.discovery)
        clusters.append(cluster)
        assignments[name] = _load_assignment(spec, name, members, local_zone)
        endpoint_sets[name] = EndpointSet(kind, local_zone)

    add(GATEWAY_CLUSTER, "gateway", of("gateway"), spec.traffic.edge, None)
    add(GATEWAY_STREAMS_CLUSTER, "gateway", of("gateway"), _streams_policy(spec), None)
    add(REGISTRY_CLUSTER, "registry", of("registry"), spec.traffic.model, None)
    # The first replica set; a version another set serves (blue-green) lists that set's.
    model_servers = spec.first_set_replicas()
    for zone in spec.zones:
        add(feature_cluster(zone), "feature", of("feature"), spec.traffic.feature, zone)
        add(model_servers_cluster(zone), "model", model_servers, spec.traffic.model, zone)
        # Every model server may host every version; a cluster per version is what lets a
        # weighted route pick the version and keeps its retries within it, and its health
        # checks ask for the version's own status, so only replicas holding it count.
        for model_name, model in sorted(spec.models.items()):
            for version in sorted(model.versions):
                add(
                    model_cluster(model_name, version, zone),
                    "model",
                    spec.version_replicas(model_name, version),
                    _policy_for(spec, model),
                    zone,
                    health_name=version_health_name(model_name, version),
                )
            if model.shadow is not None:
                add(
                    shadow_cluster(model_name, model.shadow.version, zone),
                    "model",
                    spec.version_replicas(model_name, model.shadow.version),
                    _policy_for(spec, model),
                    zone,
                    _shadow_marking(model.shadow.version),
                    health_name=version_health_name(model_name, model.shadow.version),
                )

    if (collector := collector_cluster(spec)) is not None:
        if spec.embedded_trace_store_port is not None:
            # The mesh's own trace store takes spans over mutual TLS, as every hop does.
            collector[0]["transport_socket"] = upstream_tls(spec, "tracestore")
        if spec.discovery.backend == "dns" and collector_is_named(spec):
            # The store in a container of its own: Envoy resolves its name, as the
            # services'.
            del collector[0]["type"]
            collector[0]["cluster_type"] = _dns_cluster_type(spec.discovery)
        clusters.append(collector[0])
        assignments[collector[0]["name"]] = collector[1]

    route_configs = {
        "edge": {
            "name": "edge",
            # Removals on the virtual host run before a route's own additions (Envoy's
            # default is the reverse: the least specific level would win).
            "most_specific_header_mutations_wins": True,
            "virtual_hosts": [
                {
                    "name": "edge",
                    "domains": ["*"],
                    "routes": _edge_routes(spec),
                    "request_headers_to_remove": list(_EDGE_REMOVED_HEADERS),
                }
            ],
        }
    }
    listeners = []
    # Rate limiting first, so a flood of bad credentials is shed before any auth work;
    # control calls are refused whatever credentials they carry.
    edge_filters = []
    if spec.traffic.rate_limit.enabled:
        edge_filters.append(_rate_limit_filter(spec.traffic.rate_limit))
    edge_filters.append(_control_calls_denied())
    edge_filters += _edge_auth_filters(spec)
    # REST/JSON callers, after auth (a caller without credentials never gets a body held
    # or parsed): their calls made gRPC before the limits and routes below judge them
    # (proxy/transcoder.py). No control method has a REST binding, so the denial above
    # cannot be dodged by one (tests/unit/test_rest_bindings.py).
    edge_filters += [json_body_limit_filter(spec), transcoder_filter(spec)]
    if spec.traffic.rate_limit.enabled:
        edge_filters.append(_caller_rate_limit_filter(spec.traffic.rate_limit))
    # Last: only calls the edge admits spend the forced-trace budget (a caller without
    # credentials cannot drain it for the others).
    if (forced := forced_traces_filter(spec)) is not None:
        edge_filters.append(forced)
    # Every edge Envoy holds the same edge listener on its own port, logging to its own
    # file (envoy-edge-access.log for the first zone's, as with a single edge).
    edge_port = spec.edge_port_of(proxy) if is_edge_proxy(proxy) else spec.ports.edge
    edge_log = "edge" if proxy == EDGE_PROXY or not is_edge_proxy(proxy) else proxy
    listeners.append(
        _listener(
            "edge", spec, edge_port, "edge", log_dir, edge_filters, edge=True, log_name=edge_log
        )
    )
    for zone in spec.zones:
        name = mesh_route_config(zone)
        route_configs[name] = {
            "name": name,
            # The virtual host removes a caller's shadow role before the route marks the
            # primary call and the split names the version.
            "most_specific_header_mutations_wins": True,
            "virtual_hosts": [
                {
                    "name": name,
                    "domains": ["*"],
                    "routes": _mesh_routes(spec, zone),
                    "request_headers_to_remove": list(_MESH_SET_HEADERS),
                }
            ],
        }
        listeners.append(
            _listener(
                name,
                spec,
                spec.mesh_ports[zone],
                name,
                log_dir,
                [_control_calls_denied()],
                edge=False,
            )
        )
    _add_stats_listener(spec, log_dir, listeners, route_configs, clusters, assignments, proxy)
    if spec.discovery.backend == "dns":
        # Envoy resolves the names itself: no endpoint file, no control plane.
        clusters = [_inline_endpoints(c, assignments[c["name"]]) for c in clusters]
    return EnvoyResources(
        listeners=listeners,
        route_configs=route_configs,
        clusters=clusters,
        load_assignments=assignments,
        endpoint_sets=endpoint_sets,
    )


def _add_stats_listener(
    spec: ResolvedSpec,
    log_dir: Path,
    listeners: list[dict[str, Any]],
    route_configs: dict[str, dict[str, Any]],
    clusters: list[dict[str, Any]],
    assignments: dict[str, dict[str, Any]],
    proxy: str = EDGE_PROXY,
) -> None:
    """An Envoy's stats for Prometheus, on a loopback port of their own (ports.envoy_stats;
    a zone Envoy's in the per-zone layout: zone_stats_ports).

    The admin API stays on its Unix socket (it can stop Envoy and rewrite its runtime):
    this listener's one route is `GET /stats/prometheus`, proxied to that socket; every
    other path and method (/quitquitquit, /runtime_modify, /stats?format=json...) is 404.
    """
    name = ENVOY_STATS_LISTENER
    route_configs[name] = {
        "name": name,
        "virtual_hosts": [
            {
                "name": name,
                "domains": ["*"],
                "routes": [
                    {
                        "match": {
                            "path": ENVOY_STATS_PATH,
                            "headers": [
                                {"name": ":method", "string_match": {"exact": "GET"}},
                            ],
                        },
                        "route": {"cluster": ENVOY_ADMIN_CLUSTER, "timeout": "5s"},
                    }
                ],
            }
        ],
    }
    hcm = {
        "@type": _HCM,
        "stat_prefix": name,
        "codec_type": "HTTP1",
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "access_log": [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": _FILE_LOG,
                    "path": str(log_dir / f"{_log_prefix(proxy)}-{name}.log"),
                },
            }
        ],
        "rds": {"route_config_name": name},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    listeners.append(
        {
            "name": name,
            "address": _address(spec.listen_host, spec.proxy_stats_port(proxy)),
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": hcm,
                        }
                    ]
                }
            ],
        }
    )
    # The admin socket, spoken to in HTTP/1.1 like any admin client.
    clusters.append({"name": ENVOY_ADMIN_CLUSTER, "connect_timeout": "0.25s", "type": "EDS"})
    socket_address = {"pipe": {"path": str(admin_socket_path(spec.state_dir, proxy))}}
    assignments[ENVOY_ADMIN_CLUSTER] = {
        "cluster_name": ENVOY_ADMIN_CLUSTER,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address}}]}],
    }


def _overload_manager(overload: Overload) -> dict[str, Any]:
    heap = "envoy.resource_monitors.fixed_heap"
    connections = "envoy.resource_monitors.global_downstream_max_connections"
    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {
                "name": heap,
                "typed_config": {
                    "@type": _FIXED_HEAP,
                    "max_heap_size_bytes": overload.max_heap_mb * 1024 * 1024,
                },
            },
            {
                "name": connections,
                "typed_config": {
                    "@type": _DOWNSTREAM_CONNECTIONS,
                    "max_active_downstream_connections": overload.max_downstream_connections,
                },
            },
        ],
        "actions": [
            {
                "name": "envoy.overload_actions.shrink_heap",
                "triggers": [{"name": heap, "threshold": {"value": 0.95}}],
            },
            {
                "name": "envoy.overload_actions.stop_accepting_requests",
                "triggers": [{"name": heap, "threshold": {"value": 0.98}}],
            },
        ],
    }


def _runtime_layers(spec: ResolvedSpec) -> list[dict[str, Any]]:
    static = {**tracer_runtime(spec), **listener_connection_limits(spec)}
    layers: list[dict[str, Any]] = [{"name": "static", "static_layer": static}]
    if spec.traffic.runtime_overrides:
        # The drill profile: the admin layer lets drills flip runtime keys (fault
        # percentages, shadow shares) without a restart. Without it, Envoy refuses
        # /runtime_modify and only the spec changes what it does.
        layers.append({"name": "admin", "admin_layer": {}})
    return layers


def _log_prefix(proxy: str) -> str:
    """The edge's (the shared Envoy's) logs are envoy-*.log, a zone Envoy's envoy-<zone>-*."""
    return "envoy" if proxy == EDGE_PROXY else f"envoy-{proxy}"


def _bootstrap_base(spec: ResolvedSpec, log_dir: Path, proxy: str) -> dict[str, Any]:
    node = spec.name if proxy == EDGE_PROXY else f"{spec.name}-{proxy}"
    return {
        "node": {"id": node, "cluster": spec.name},
        "admin": {
            # A Unix socket in a 0700 directory, never a TCP port: only the mesh's user can
            # reach the API that stops Envoy and rewrites its runtime.
            "address": {
                "pipe": {
                    "path": str(admin_socket_path(spec.state_dir, proxy)),
                    "mode": ADMIN_SOCKET_MODE,
                }
            },
            "access_log": [
                {
                    "name": "envoy.access_loggers.file",
                    "typed_config": {
                        "@type": _FILE_LOG,
                        "path": str(log_dir / f"{_log_prefix(proxy)}-admin-access.log"),
                    },
                }
            ],
        },
        "layered_runtime": {"layers": _runtime_layers(spec)},
        "overload_manager": _overload_manager(spec.traffic.overload),
    }


def static_bootstrap(
    spec: ResolvedSpec, resources: EnvoyResources, log_dir: Path, proxy: str = EDGE_PROXY
) -> dict[str, Any]:
    """One self-contained config: what `envoy --mode validate` checks and people read."""
    listeners = []
    for listener in resources.listeners:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        inline = {k: v for k, v in hcm.items() if k != "rds"}
        inline["route_config"] = resources.route_configs[hcm["rds"]["route_config_name"]]
        first = listener["filter_chains"][0]
        chain = {**first, "filters": [{**first["filters"][0], "typed_config": inline}]}
        listeners.append({**listener, "filter_chains": [chain]})
    clusters = [
        {**c, "type": "STATIC", "load_assignment": resources.load_assignments[c["name"]]}
        if is_eds(c)
        else c
        for c in resources.clusters
    ]
    return {
        **_bootstrap_base(spec, log_dir, proxy),
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def _file_source(path: Path) -> dict[str, Any]:
    # Envoy reloads the file when one is renamed into the watched folder (an atomic swap);
    # writes in place are not noticed.
    return {
        "path_config_source": {"path": str(path), "watched_directory": {"path": str(path.parent)}},
        "resource_api_version": "V3",
    }


def dynamic_bootstrap(
    spec: ResolvedSpec,
    resources: EnvoyResources,
    layout: XdsLayout,
    log_dir: Path,
    proxy: str = EDGE_PROXY,
) -> dict[str, Any]:
    """The bootstrap Envoy runs with: static listeners, everything else from watched files."""
    listeners = []
    for listener in resources.listeners:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        name = hcm["rds"]["route_config_name"]
        rds = {"route_config_name": name, "config_source": _file_source(layout.rds(name))}
        first = listener["filter_chains"][0]
        chain = {**first, "filters": [{**first["filters"][0], "typed_config": {**hcm, "rds": rds}}]}
        listeners.append({**listener, "filter_chains": [chain]})
    return {
        **_bootstrap_base(spec, log_dir, proxy),
        "static_resources": {"listeners": listeners},
        "dynamic_resources": {"cds_config": _file_source(layout.cds)},
    }


def xds_files(
    resources: EnvoyResources, layout: XdsLayout, version: str
) -> dict[Path, dict[str, Any]]:
    """The content of every watched file, by path, stamped with `version`."""
    files: dict[Path, dict[str, Any]] = {}
    clusters = []
    for cluster in resources.clusters:
        name = cluster["name"]
        if not is_eds(cluster):  # its endpoints inline (discovery.backend dns)
            clusters.append({"@type": CLUSTER_TYPE, **cluster})
            continue
        files[layout.eds(name)] = {
            "version_info": version,
            "resources": [{"@type": ENDPOINTS_TYPE, **resources.load_assignments[name]}],
        }
        clusters.append(
            {
                "@type": CLUSTER_TYPE,
                **cluster,
                "eds_cluster_config": {"eds_config": _file_source(layout.eds(name))},
            }
        )
    files[layout.cds] = {"version_info": version, "resources": clusters}
    for name, config in resources.route_configs.items():
        files[layout.rds(name)] = {
            "version_info": version,
            "resources": [{"@type": ROUTES_TYPE, **config}],
        }
    return files
