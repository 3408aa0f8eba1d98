"""The wire contract: every name that crosses a process boundary, defined once.

Headers, OIP parameters, gRPC method paths, Envoy cluster and route names and the gRPC
channel options all live here. Services, the Envoy renderer, the operator tooling, the
drills and the benchmarks import them from this module; a rename is one edit, and a test
that greps the tree keeps it that way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

# --- request headers (gRPC metadata keys are lower case) -------------------------------------

# Names the model a call is for; Envoy's mesh routes match on it.
MODEL_HEADER: Final = "x-servemesh-model"
# Pins a model version; absent, the weighted split picks one.
VERSION_HEADER: Final = "x-servemesh-model-version"
# Set by Envoy on shadowed calls: "primary" on the served copy, "shadow" on the mirror.
SHADOW_ROLE_HEADER: Final = "x-servemesh-shadow-role"
SHADOW_ROLE_PRIMARY: Final = "primary"
SHADOW_ROLE_SHADOW: Final = "shadow"
# The gateway's sticky bucket of a call: a stable hash of its first entity id into
# 0..BUCKETS-1. Envoy routes bucket ranges to versions, so an entity keeps its version while
# the weights stand; a call without it (no entity) takes the weighted split.
BUCKET_HEADER: Final = "x-servemesh-bucket"
# Buckets per model: 10,000 (basis points), so whole-percent weights map to whole ranges.
BUCKETS: Final = 10_000
# On an answer Envoy routed by the bucket header: the matched route's range, "start-end"
# ([start, end)). The gateway checks that every call sharing one ModelInfer belonged there.
BUCKET_RANGE_HEADER: Final = "x-servemesh-bucket-range"


def bucket_ranges(traffic: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """Each version's sticky buckets, [start, end) of 0..BUCKETS, from whole-percent weights:
    consecutive ranges in version order; a version of weight 0 has none. Envoy's bucket
    routes are rendered from it (servemesh/proxy/render.py); the gateway groups calls by it.

    The order is fixed, so as weight moves between two versions only the boundary between
    their ranges moves: an entity the canary got at 5% still gets it at 25%, and one the
    baseline keeps at 25% had it at 5% too."""
    ranges: dict[str, tuple[int, int]] = {}
    start = 0
    for version, weight in sorted(traffic.items()):
        end = start + weight * BUCKETS // 100
        if end > start:
            ranges[version] = (start, end)
        start = end
    return ranges


# Who called through the edge, as Envoy's edge auth established it: the verified token's
# `role` claim and its subject (`sub`). Envoy's jwt_authn sets them from a token it
# verified; a caller's own copies are removed at the edge before any auth filter runs
# (servemesh/proxy/render.py), and the gateway believes them only on a connection from
# Envoy. The per-caller rate limit keys on CALLER_HEADER.
CALLER_ROLE_HEADER: Final = "x-servemesh-caller-role"
CALLER_HEADER: Final = "x-servemesh-caller"
# The edge's account of the caller's verified client certificate (Envoy's SANITIZE_SET:
# a caller's own copy is never passed on); its URI is the certificate's SPIFFE id.
CLIENT_CERT_HEADER: Final = "x-forwarded-client-cert"
# The gateway's per-version counters say how a call chose its version: the traffic split
# (routed: what a rollout's analysis judges) or the caller's pin (pinned: counted apart).
ROUTE_ROUTED: Final = "routed"
ROUTE_PINNED: Final = "pinned"

# One id per caller request, generated at the edge when the caller sent none.
REQUEST_ID_HEADER: Final = "x-request-id"
# W3C trace context, passed on unchanged by every hop.
TRACE_HEADERS: Final = ("traceparent", "tracestate")
AUTHORIZATION_HEADER: Final = "authorization"

# --- trace span attributes (the services set them, the trace store reads them) ---------------


class Span:
    """Attribute names on servemesh's spans. A namespace rather than module constants:
    "servemesh.model" also begins module paths (servemesh.bench.model), which the
    one-spelling check would take for second spellings."""

    REQUEST_ID: Final = "servemesh.request_id"
    MODEL: Final = "servemesh.model"
    VERSION: Final = "servemesh.version"
    # The model server: a request's time in the batcher's queue (a batch: the longest and
    # the mean), a batch's rows, requests, forward pass and the version it ran.
    QUEUE_WAIT_MS: Final = "servemesh.queue_wait_ms"
    QUEUE_WAIT_MEAN_MS: Final = "servemesh.queue_wait_mean_ms"
    BATCH_SIZE: Final = "servemesh.batch_size"
    BATCH_REQUESTS: Final = "servemesh.batch_requests"
    FORWARD_MS: Final = "servemesh.forward_ms"
    BATCHER: Final = "servemesh.batcher"


def envoy_trace_service(listener: str) -> str:
    """How an Envoy listener names itself in its spans (service.name): envoy-<listener>."""
    return f"envoy-{listener}"


# --- OIP v2 response parameters the model server sets ----------------------------------------

# Which replica and zone computed the answer.
REPLICA_PARAMETER: Final = "servemesh_replica"
ZONE_PARAMETER: Final = "servemesh_zone"
# Milliseconds a call to an on-demand pool waited for its version's load (double_param);
# absent when the version was loaded already (docs/models.md, "Many models in one pool").
LOAD_WAIT_PARAMETER: Final = "servemesh_load_wait_ms"

# --- OIP model-repository parameters ------------------------------------------------------

# RepositoryModelLoad/Unload: the version to load or unload (string_param).
LOAD_VERSION_PARAMETER: Final = "version"
# RepositoryModelLoad: the model's spec entry as JSON (string_param), so a replica can load
# a version of a model (or a model) its spec does not list yet; `servemesh apply` sends it.
LOAD_CONFIG_PARAMETER: Final = "config"

# --- tensors --------------------------------------------------------------------------------

# The OIP v2 tensor datatypes (the registry records them; the gateway carries all but BYTES).
OIP_DATATYPES: Final = frozenset(
    {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
    | {"FP16", "BF16", "FP32", "FP64", "BYTES"}
)

# The typed fields a public Tensor (servemesh.gateway.v1) may hold its values in, one per
# datatype family; a tensor fills exactly one of them.
TENSOR_VALUE_FIELDS: Final = (
    "float_values",
    "double_values",
    "int64_values",
    "int_values",
    "uint64_values",
    "uint_values",
    "bool_values",
)

# --- gRPC services and method paths ----------------------------------------------------------

OIP_SERVICE: Final = "inference.GRPCInferenceService"
FEATURE_SERVICE: Final = "servemesh.feature.v1.FeatureService"
GATEWAY_SERVICE: Final = "servemesh.gateway.v1.Gateway"
REGISTRY_SERVICE: Final = "servemesh.registry.v1.Registry"
HEALTH_SERVICE: Final = "grpc.health.v1.Health"
REFLECTION_PREFIX: Final = "/grpc.reflection."
# Server reflection's one method, in both published versions of the service.
REFLECTION_METHODS: Final = tuple(
    f"{REFLECTION_PREFIX}{version}.ServerReflection/ServerReflectionInfo"
    for version in ("v1alpha", "v1")
)


def method_prefix(service: str) -> str:
    """The path prefix every method of `service` shares: `/pkg.Service/`."""
    return f"/{service}/"


def method_path(service: str, method: str) -> str:
    """The HTTP/2 path of one gRPC method: `/pkg.Service/Method`."""
    return f"/{service}/{method}"


OIP_PREFIX: Final = method_prefix(OIP_SERVICE)


def version_health_name(model: str, version: str) -> str:
    """The gRPC health service name under which a model replica reports one version:
    SERVING exactly while that version is loaded and warmed up, its last readiness check
    passed (sample rows through its worker thread, finite outputs of the declared shape), and
    the replica is not draining. Each version's Envoy cluster health-checks this name."""
    return f"{OIP_SERVICE}/{model}/{version}"


# A model server's health (grpc.health.v1) answers, beside the overall name "" and its
# service names: READINESS_HEALTH_NAME as the overall name (every routed version loaded and
# its readiness check passing: what Envoy's clusters and the gateways follow), and
# LIVENESS_HEALTH_NAME (the process, its event loop and its models' threads respond: what a
# supervisor would restart on). A draining replica is not ready but still alive.
READINESS_HEALTH_NAME: Final = "readiness"
LIVENESS_HEALTH_NAME: Final = "liveness"

MODEL_INFER_METHOD: Final = method_path(OIP_SERVICE, "ModelInfer")

# Calls that change what the mesh serves: registry writes, model loads and unloads, feature
# writes. They are control calls, not data-plane calls: refused on Envoy's edge and mesh
# listeners, and answered by a service only to a caller holding the mesh's control credential.
CONTROL_METHODS: Final = frozenset(
    {
        method_path(REGISTRY_SERVICE, "CreateModel"),
        method_path(REGISTRY_SERVICE, "UploadVersion"),
        method_path(REGISTRY_SERVICE, "SetAlias"),
        method_path(OIP_SERVICE, "RepositoryModelLoad"),
        method_path(OIP_SERVICE, "RepositoryModelUnload"),
        method_path(FEATURE_SERVICE, "WriteFeatures"),
        method_path(FEATURE_SERVICE, "LoadFeatures"),
    }
)
HEALTH_PREFIX: Final = method_prefix(HEALTH_SERVICE)
# Envoy's per-method gRPC stats name a method `<package>.<Service>.<Method>`.
MODEL_INFER_STAT: Final = f"{OIP_SERVICE}.ModelInfer"

# Status codes that count against a service's success SLI (the recording rules, `servemesh
# top`): the service failed. A caller's own errors (INVALID_ARGUMENT, NOT_FOUND, ...) and
# a caller giving up (CANCELLED) do not.
SLI_FAILURE_CODES: Final = (
    "UNAVAILABLE",
    "INTERNAL",
    "UNKNOWN",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED",
    "DATA_LOSS",
    "UNIMPLEMENTED",
)
# Upper bounds (seconds) of every service's latency histograms (servemesh_rpc_duration_seconds,
# servemesh_gateway_predict_duration_seconds, ...): the `le` labels Prometheus stores, from
# which the SLO rules count the calls slower than a model's p99 objective.
LATENCY_BUCKETS_S: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# Upper bounds of the gateways' per-version score histogram (the rollout's distribution
# check reads them back as Prometheus `le` labels; the shadow step buckets the replicas'
# recorded scores with the same bounds). Twenty equal bins over [0, 1], where probabilities
# live, so a population stability index has bins fine enough to merge into deciles; and a
# few wide bins on either side, so a model scoring outside [0, 1] still lands in finite
# buckets and a gross shift of its scores still moves mass between them.
SCORE_BUCKETS: Final = (
    (-100.0, -10.0, -1.0, 0.0) + tuple(round(i / 20, 2) for i in range(1, 21)) + (2.0, 10.0, 100.0)
)

# --- Envoy cluster and route names -----------------------------------------------------------

GATEWAY_CLUSTER: Final = "gateway"
REGISTRY_CLUSTER: Final = "registry"
# Envoy's stats in Prometheus form: a loopback listener whose one route leads to the admin
# socket, and the one path it serves.
ENVOY_STATS_LISTENER: Final = "envoy-stats"
ENVOY_ADMIN_CLUSTER: Final = "admin-socket"
ENVOY_STATS_PATH: Final = "/stats/prometheus"

# Envoy's OTLP exporter sends its spans to the trace collector through this cluster.
TRACE_COLLECTOR_CLUSTER: Final = "trace_collector"
_VIA: Final = "-via-"


# A gateway's answer header saying its own way downstream (its zone's Envoy) failed, not the
# hop it called: the edge retries such a call on another zone's gateway (per-zone layout).
RETRY_ELSEWHERE_HEADER: Final = "x-servemesh-retry-elsewhere"
# The transport errors (grpc core's words) of a call whose connection to the mesh listener
# was refused or lost: no answer came from Envoy or a replica.
_PATH_LOST_WORDS: Final = (
    "failed to connect",
    "connection refused",
    "socket closed",
    "connection reset",
    "broken pipe",
)


def lost_the_mesh_listener(code_name: str, details: str) -> bool:
    """A failed call's status (its code's name and details) says the connection to the
    mesh listener was refused or lost, rather than carrying Envoy's or a replica's answer."""
    found = details.lower()
    return code_name == "UNAVAILABLE" and any(word in found for word in _PATH_LOST_WORDS)


def model_cluster(model: str, version: str, zone: str) -> str:
    """The cluster of one model version as seen from callers in `zone`."""
    return f"model-{model}-{version}{_VIA}{zone}"


def shadow_cluster(model: str, version: str, zone: str) -> str:
    """The cluster mirrored copies of `model`'s calls go through to reach `version`."""
    return f"shadow-{model}-{version}{_VIA}{zone}"


def feature_cluster(zone: str) -> str:
    """The feature services as seen from callers in `zone`."""
    return f"feature{_VIA}{zone}"


def model_servers_cluster(zone: str) -> str:
    """Every model server (OIP calls with no model header), as seen from `zone`."""
    return f"model-servers{_VIA}{zone}"


def zone_of_cluster(cluster: str) -> str | None:
    """The calling zone a zone-scoped cluster serves; None for zone-less clusters."""
    _, sep, zone = cluster.rpartition(_VIA)
    return zone if sep else None


def is_shadow_cluster(cluster: str) -> bool:
    return cluster.startswith("shadow-")


def mesh_route_config(zone: str) -> str:
    """The route configuration of `zone`'s mesh listener."""
    return f"mesh-{zone}"


def fault_runtime_prefix(route: str) -> str:
    """Runtime keys a drill sets to inject faults on a route: <prefix>.abort_percent, ..."""
    return f"fault.{route}"


# --- gRPC channel options --------------------------------------------------------------------


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel or server options that send and receive messages up to the given size."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def reconnect_backoff_options(max_ms: int) -> list[tuple[str, int]]:
    """Channel options that retry a lost connection at least every `max_ms` (gRPC's default
    backoff grows to two minutes: a health probe would miss a replica's return that long)."""
    return [
        ("grpc.initial_reconnect_backoff_ms", min(100, max_ms)),
        ("grpc.min_reconnect_backoff_ms", min(100, max_ms)),
        ("grpc.max_reconnect_backoff_ms", max_ms),
    ]


# A gateway's health watch of a replica (services/gateway/health.py) pings every second and
# gives a stalled peer two seconds to answer (as the Check it replaced needed two failed
# rounds of a second: one slow answer on a busy machine does not drop a replica); every
# service accepts pings that often (services/runtime/server.py), so a quiet watch is never
# refused for pinging.
HEALTH_WATCH_PING_MS: Final = 1000
HEALTH_WATCH_PING_TIMEOUT_MS: Final = 2000
MIN_PING_INTERVAL_MS: Final = 500


def health_watch_options() -> list[tuple[str, int]]:
    """Channel options of a long-lived health watch: keepalive pings that notice a peer
    that stalls without closing its connection."""
    return [
        ("grpc.keepalive_time_ms", HEALTH_WATCH_PING_MS),
        ("grpc.keepalive_timeout_ms", HEALTH_WATCH_PING_TIMEOUT_MS),
        # Without it a ping unanswered is never held against the connection (grpcio 1.7x
        # times pings out by this argument, not by the keepalive timeout alone).
        ("grpc.http2.ping_timeout_ms", HEALTH_WATCH_PING_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
