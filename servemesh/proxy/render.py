"""Render Envoy's bootstrap config from the mesh spec.

Two listeners, one per role: the edge listener is what clients call (it fronts the
gateways); the mesh listener carries service-to-service calls (gateway -> feature,
gateway -> model). Resilience lives here, not in application retry loops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from servemesh.spec import HealthCheckPolicy, Instance, MeshSpec, RetryPolicy

MODEL_HEADER = "x-servemesh-model"
VERSION_HEADER = "x-servemesh-model-version"
OIP_PREFIX = "/inference.GRPCInferenceService/"

_HCM = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_FILE_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"
_PREVIOUS_HOSTS = (
    "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
)

# One JSON object per request: enough to follow a request id through both listeners.
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
}


def model_cluster_name(model: str, version: str) -> str:
    return f"model-{model}-{version}"


def _ms(value: int | float) -> str:
    return f"{value / 1000:.3f}s"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _cluster(name: str, spec: MeshSpec, instances: list[Instance]) -> dict[str, Any]:
    """A gRPC upstream cluster: HTTP/2, one locality per zone, active gRPC health checks."""
    by_zone: dict[str, list[Instance]] = {}
    for inst in instances:
        by_zone.setdefault(inst.zone, []).append(inst)
    health: HealthCheckPolicy = spec.resilience.health_checks
    return {
        "name": name,
        "type": "STATIC",
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
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "locality": {"zone": zone},
                    "lb_endpoints": [
                        {"endpoint": {"address": _address(spec.host, spec.port_of(i.name))}}
                        for i in members
                    ],
                }
                for zone, members in sorted(by_zone.items())
            ],
        },
        "health_checks": [
            {
                "timeout": _ms(health.timeout_ms),
                "interval": _ms(health.interval_ms),
                "no_traffic_interval": _ms(health.no_traffic_interval_ms),
                "unhealthy_threshold": health.unhealthy_threshold,
                "healthy_threshold": health.healthy_threshold,
                "grpc_health_check": {},
            }
        ],
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_gateway_failure": 3,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 50,
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 1024,
                    "max_pending_requests": 1024,
                    "max_requests": 1024,
                    # Retries may use a share of live requests, never less than a few: a
                    # fixed max_retries (default 3) starves retries under concurrency.
                    "retry_budget": {"budget_percent": {"value": 25.0}, "min_retry_concurrency": 8},
                }
            ]
        },
    }


def _retry_policy(policy: RetryPolicy) -> dict[str, Any]:
    retry: dict[str, Any] = {
        "retry_on": ",".join(policy.retry_on),
        "num_retries": policy.num_retries,
        "retry_back_off": {
            "base_interval": _ms(policy.backoff_base_ms),
            "max_interval": _ms(policy.backoff_max_ms),
        },
        # Try another replica rather than the one that just failed.
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _PREVIOUS_HOSTS},
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }
    if policy.per_try_timeout_ms:
        retry["per_try_timeout"] = _ms(policy.per_try_timeout_ms)
    return retry


def _grpc_route(spec: MeshSpec, retry: dict[str, Any] | None) -> dict[str, Any]:
    """Route settings every gRPC route shares: deadlines come from the caller."""
    route: dict[str, Any] = {
        # Envoy's default 15 s route timeout would cut long calls and answer UNAVAILABLE;
        # gRPC callers carry their own deadline in grpc-timeout, which Envoy enforces below.
        "timeout": "0s",
        "max_stream_duration": {
            "grpc_timeout_header_max": "0s",
            "max_stream_duration": _ms(spec.deadlines.default_timeout_ms),
        },
    }
    if retry:
        route["retry_policy"] = retry
    return route


def _mesh_routes(spec: MeshSpec) -> list[dict[str, Any]]:
    retry = _retry_policy(spec.resilience.retries)
    routes: list[dict[str, Any]] = []
    for model_name, model in sorted(spec.models.items()):
        model_match = {"name": MODEL_HEADER, "string_match": {"exact": model_name}}
        # A pinned version goes straight to its cluster.
        for version in sorted(model.versions):
            routes.append(
                {
                    "name": f"{model_name}-{version}-pinned",
                    "match": {
                        "prefix": OIP_PREFIX,
                        "headers": [
                            model_match,
                            {"name": VERSION_HEADER, "string_match": {"exact": version}},
                        ],
                    },
                    "route": {
                        "cluster": model_cluster_name(model_name, version),
                        **_grpc_route(spec, retry),
                    },
                }
            )
        # Unpinned: the traffic split picks the version and tells the replica which one.
        routes.append(
            {
                "name": f"{model_name}-split",
                "match": {"prefix": OIP_PREFIX, "headers": [model_match]},
                "route": {
                    "weighted_clusters": {
                        "clusters": [
                            {
                                "name": model_cluster_name(model_name, version),
                                "weight": weight,
                                "request_headers_to_add": [
                                    {
                                        "header": {"key": VERSION_HEADER, "value": version},
                                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                                    }
                                ],
                            }
                            for version, weight in sorted(model.traffic.items())
                        ]
                    },
                    **_grpc_route(spec, retry),
                },
            }
        )
    routes += [
        {
            "name": "feature",
            "match": {"prefix": "/servemesh.feature.v1.FeatureService/"},
            "route": {"cluster": "feature", **_grpc_route(spec, retry)},
        },
        {
            "name": "registry",
            "match": {"prefix": "/servemesh.registry.v1.Registry/"},
            "route": {"cluster": "registry", **_grpc_route(spec, None)},
        },
        # OIP calls without a model header (tritonclient, grpcurl): any model server.
        {
            "name": "model-servers",
            "match": {"prefix": OIP_PREFIX},
            "route": {"cluster": "model-servers", **_grpc_route(spec, retry)},
        },
    ]
    return routes


def _listener(
    name: str, spec: MeshSpec, port: int, routes: list[dict[str, Any]], log_dir: Path
) -> dict[str, Any]:
    return {
        "name": name,
        "address": _address(spec.host, port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": _HCM,
                            "stat_prefix": name,
                            "codec_type": "AUTO",
                            "generate_request_id": True,
                            # Keep a caller's x-request-id so one id follows the request
                            # through the edge, the gateway and the mesh.
                            "preserve_external_request_id": True,
                            "http2_protocol_options": {"max_concurrent_streams": 1024},
                            "access_log": [
                                {
                                    "name": "envoy.access_loggers.file",
                                    "typed_config": {
                                        "@type": _FILE_LOG,
                                        "path": str(log_dir / f"envoy-{name}-access.log"),
                                        "log_format": {"json_format": _ACCESS_LOG_FORMAT},
                                    },
                                }
                            ],
                            "route_config": {
                                "name": f"{name}-routes",
                                "virtual_hosts": [
                                    {"name": name, "domains": ["*"], "routes": routes}
                                ],
                            },
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {"@type": _ROUTER},
                                }
                            ],
                        },
                    }
                ]
            }
        ],
    }


def render_bootstrap(spec: MeshSpec, log_dir: Path) -> dict[str, Any]:
    """The whole Envoy bootstrap for a spec whose ports are resolved."""
    instances = spec.instances()

    def of(service: str) -> list[Instance]:
        return [i for i in instances if i.service == service]

    model_servers = of("model")
    clusters = [
        _cluster("gateway", spec, of("gateway")),
        _cluster("feature", spec, of("feature")),
        _cluster("registry", spec, of("registry")),
        _cluster("model-servers", spec, model_servers),
    ]
    # Every model server hosts every version today; a cluster per version is what lets a
    # weighted route pick the version and retries stay within it.
    for model_name, model in sorted(spec.models.items()):
        for version in sorted(model.versions):
            clusters.append(_cluster(model_cluster_name(model_name, version), spec, model_servers))

    edge_route = {
        "name": "gateway",
        "match": {"prefix": "/"},
        "route": {
            "cluster": "gateway",
            # The gateway's own downstream calls are retried on the mesh listener; retrying
            # here too would multiply attempts, so the edge only retries what never reached
            # a gateway.
            **_grpc_route(
                spec,
                {
                    "retry_on": "connect-failure,refused-stream",
                    "num_retries": 2,
                    "retry_host_predicate": [
                        {
                            "name": "envoy.retry_host_predicates.previous_hosts",
                            "typed_config": {"@type": _PREVIOUS_HOSTS},
                        }
                    ],
                },
            ),
        },
    }
    return {
        "node": {"id": spec.name, "cluster": spec.name},
        "admin": {
            "address": _address(spec.host, spec.ports.envoy_admin),
            "access_log": [
                {
                    "name": "envoy.access_loggers.file",
                    "typed_config": {
                        "@type": _FILE_LOG,
                        "path": str(log_dir / "envoy-admin-access.log"),
                    },
                }
            ],
        },
        # The admin layer lets drills flip runtime keys (fault percentages) without a restart.
        "layered_runtime": {
            "layers": [
                {"name": "static", "static_layer": {}},
                {"name": "admin", "admin_layer": {}},
            ]
        },
        "static_resources": {
            "listeners": [
                _listener("edge", spec, spec.ports.edge, [edge_route], log_dir),
                _listener("mesh", spec, spec.ports.mesh, _mesh_routes(spec), log_dir),
            ],
            "clusters": clusters,
        },
    }


def write_bootstrap(spec: MeshSpec, path: Path, log_dir: Path) -> Path:
    """Write the bootstrap atomically (rename into place) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(
        "# Rendered by servemesh from the mesh spec; edit the spec, not this file.\n"
        + yaml.safe_dump(render_bootstrap(spec, log_dir), sort_keys=False)
    )
    tmp.replace(path)
    return path
