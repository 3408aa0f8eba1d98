"""Traffic policy in the mesh spec: what Envoy does on each route and to each cluster.

The defaults are chosen for a gRPC mesh of Python services on a small machine; each field
says why where the default is not Envoy's own. docs/operators.md explains every knob.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servemesh.spec.durations import Duration

Percent = Annotated[float, Field(ge=0, le=100)]
Millis = Annotated[int, Field(ge=0, le=3_600_000)]

RETRY_CONDITIONS = {
    "5xx",
    "gateway-error",
    "reset",
    "reset-before-request",
    "connect-failure",
    "envoy-ratelimited",
    "retriable-4xx",
    "refused-stream",
    "retriable-status-codes",
    "retriable-headers",
    "http3-post-connect-failure",
    "cancelled",
    "deadline-exceeded",
    "internal",
    "resource-exhausted",
    "unavailable",
}
GRPC_CODES = {
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
}


class StrictModel(BaseModel):
    """Unknown keys are errors (a typo must not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RetryPolicy(StrictModel):
    # connect-failure, reset and refused-stream are what make a killed upstream or a
    # per-try timeout retryable; the gRPC codes alone do not.
    retry_on: list[str] = Field(
        default_factory=lambda: [
            "connect-failure",
            "refused-stream",
            "reset",
            "unavailable",
            "cancelled",
        ]
    )
    num_retries: Annotated[int, Field(ge=0, le=10)] = 2
    # 0 disables the per-try timeout; the caller's deadline still bounds every try.
    per_try_timeout_ms: Millis = 1000
    # Hedge: once a try has taken per_try_timeout_ms, send another (to another host, the
    # other zone once the local one was tried) without cancelling the first; the first
    # answer wins and the other is cancelled. For idempotent reads only (Predict's
    # ModelInfer and GetFeatures are); hedges are retries, so the retry budget bounds
    # them and a general slowdown cannot double the load. Set per_try_timeout_ms near the
    # route's baseline p95-p99 (docs/operators.md, "Hedged requests").
    hedge_on_per_try_timeout: bool = False
    backoff_base_ms: Annotated[int, Field(ge=1, le=10_000)] = 5
    backoff_max_ms: Annotated[int, Field(ge=1, le=60_000)] = 50
    # Retry on another host, and on another priority (zone) once the first has failed.
    previous_hosts: bool = True
    previous_priorities: bool = True
    # Retries may use this share of the cluster's live requests (never fewer than
    # min_retry_concurrency): a fixed cap (Envoy's default, 3) starves retries under load,
    # no cap turns an outage into a retry storm.
    budget_percent: Percent = 25.0
    min_retry_concurrency: Annotated[int, Field(ge=0, le=10_000)] = 8

    @model_validator(mode="after")
    def _known_conditions(self) -> RetryPolicy:
        unknown = sorted(set(self.retry_on) - RETRY_CONDITIONS)
        if unknown:
            raise ValueError(f"retry_on: unknown conditions {unknown}")
        if self.backoff_max_ms < self.backoff_base_ms:
            raise ValueError("backoff_max_ms: must not be below backoff_base_ms")
        if self.hedge_on_per_try_timeout and not (self.per_try_timeout_ms and self.num_retries):
            raise ValueError(
                "hedge_on_per_try_timeout: needs per_try_timeout_ms above 0 and num_retries "
                "of at least 1 (a hedge is sent when a try times out, as a retry)"
            )
        return self


class HealthCheckPolicy(StrictModel):
    interval_ms: Annotated[int, Field(ge=100, le=60_000)] = 1000
    timeout_ms: Annotated[int, Field(ge=50, le=60_000)] = 500
    unhealthy_threshold: Annotated[int, Field(ge=1, le=10)] = 2
    healthy_threshold: Annotated[int, Field(ge=1, le=10)] = 1
    # Without this Envoy probes a cluster that has seen no traffic once a minute, and a
    # fresh mesh looks dead for that long.
    no_traffic_interval_ms: Annotated[int, Field(ge=100, le=60_000)] = 1000


class CircuitBreakers(StrictModel):
    max_connections: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
    # Requests waiting for a connection; beyond it callers get a fast UNAVAILABLE.
    max_pending_requests: Annotated[int, Field(ge=0, le=1_000_000)] = 1024
    # Requests in flight to the cluster; beyond it callers get a fast UNAVAILABLE.
    max_requests: Annotated[int, Field(ge=1, le=1_000_000)] = 1024


class OutlierDetection(StrictModel):
    enabled: bool = True
    # gRPC errors in response headers count as their HTTP mapping (UNAVAILABLE = 503).
    consecutive_5xx: Annotated[int, Field(ge=1, le=1000)] = 5
    consecutive_gateway_failure: Annotated[int, Field(ge=1, le=1000)] = 3
    interval_ms: Annotated[int, Field(ge=100, le=600_000)] = 1000
    base_ejection_time_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 5000
    # Never eject more than half of a cluster: a mesh-wide fault must not empty it.
    max_ejection_percent: Annotated[int, Field(ge=0, le=100)] = 50


class FaultPolicy(StrictModel):
    """Fault injection on a route; off by default. Drills change it live through Envoy's
    runtime (keys `fault.<route>.delay_percent`, `.delay_ms`, `.abort_percent`,
    `.abort_grpc_status`), so no restart or re-render is needed."""

    # Whole percents: Envoy's runtime reads these keys as integer percentages.
    delay_percent: Annotated[int, Field(ge=0, le=100)] = 0
    delay_ms: Millis = 0
    abort_percent: Annotated[int, Field(ge=0, le=100)] = 0
    abort_status: Literal[tuple(GRPC_CODES)] = "UNAVAILABLE"  # type: ignore[valid-type]


class RoutePolicy(StrictModel):
    retries: RetryPolicy = Field(default_factory=RetryPolicy)
    # Route timeout; 0 = none. gRPC callers carry their own deadline (grpc-timeout), which
    # Envoy honours below; Envoy's default 15 s route timeout would cut long calls short.
    timeout_ms: Millis = 0
    # Cap on a caller's grpc-timeout; 0 = use the caller's deadline unchanged.
    grpc_timeout_header_max_ms: Millis = 0
    # Deadline for calls that arrive without one.
    max_stream_duration_ms: Millis = 30_000
    circuit_breakers: CircuitBreakers = Field(default_factory=CircuitBreakers)
    outlier_detection: OutlierDetection = Field(default_factory=OutlierDetection)
    health_checks: HealthCheckPolicy = Field(default_factory=HealthCheckPolicy)
    fault: FaultPolicy = Field(default_factory=FaultPolicy)


def _edge_policy() -> RoutePolicy:
    # The gateway's own calls are retried on the mesh listener; retrying at the edge too
    # would multiply attempts, so the edge retries only what never reached a gateway, and
    # has no per-try timeout: a gateway busy with its downstream calls is not a failure
    # (a starved one is for `edge_hedge`, which races it instead of failing it).
    # A caller's grpc-timeout is capped at the edge: a client asking for an hour must not
    # hold a gateway (and its downstream calls) that long.
    return RoutePolicy(
        retries=RetryPolicy(retry_on=["connect-failure", "refused-stream"], per_try_timeout_ms=0),
        grpc_timeout_header_max_ms=60_000,
    )


class EdgeHedge(StrictModel):
    """Hedged calls at the edge, for the two idempotent reads a caller makes there (Predict
    and OIP ModelInfer, REST calls included once transcoded): once a gateway has held one
    for `after_ms`, the edge sends it to another gateway too, without cancelling the first;
    the first answer wins. Off (0) by default.

    This is for a gateway that is slow rather than failing (its host starved of CPU, its
    zone browned out): the edge's least-request pick samples two gateways at random, so
    with two gateways the starved one is still given a quarter of the calls whatever its
    backlog, and they run out their deadline there. Hedges are retries, so the edge's retry
    budget bounds them: a mesh-wide slowdown cannot double the load. Set `after_ms` above
    the edge's p99 in steady state and well under the deadlines callers give."""

    after_ms: Millis = 0


class RateLimit(StrictModel):
    """Token buckets on the edge listener; callers over one get RESOURCE_EXHAUSTED.

    Each caller (each client address) has a bucket of its own, so one flooding client is
    shed while the others' calls go through; the overall bucket still caps what the edge
    accepts from everyone together, so many callers at once cannot exceed what the
    gateways were sized for."""

    enabled: bool = True
    # The overall bucket, shared by every caller.
    requests_per_second: Annotated[int, Field(ge=1, le=10_000_000)] = 5000
    burst: Annotated[int, Field(ge=1, le=10_000_000)] = 10_000
    # One caller's bucket: a fifth of the overall rate, so at least five callers at their
    # own limit are needed to fill the overall bucket (never more than the overall one:
    # a smaller overall bucket lowers it to match).
    per_caller_requests_per_second: Annotated[int, Field(ge=1, le=10_000_000)] = 1000
    per_caller_burst: Annotated[int, Field(ge=1, le=10_000_000)] = 2000
    # Callers Envoy keeps a bucket for (least recently seen dropped first; a dropped
    # caller starts again with a full bucket). Past this many distinct callers at once a
    # flood from many addresses is held by the overall bucket alone.
    max_callers: Annotated[int, Field(ge=1, le=1_000_000)] = 10_000


class EdgeStreams(StrictModel):
    """Long-lived streams at the edge (health Watch, server reflection): a route and a
    cluster of their own (the same gateways), so callers holding streams open fill this
    cluster's breaker, never the one Predicts go through."""

    # Streams in flight at once from all callers; beyond it a new stream is refused at
    # once (UNAVAILABLE). A Watch client needs one; 256 leaves room for many clients and
    # stays far below the gateways' own breaker (1,024).
    max_streams: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    # A stream is ended after this long (its client opens a new one): a held stream frees
    # its place in the breaker at least this often.
    max_stream_duration_ms: Annotated[int, Field(ge=1000, le=3_600_000)] = 60_000


class ConnectionLimits(StrictModel):
    """What one client connection may hold and how long it may take, per listener.

    The overload manager's cap (overload.max_downstream_connections) is one pool for every
    listener; these caps split it, so a flood of connections to the edge leaves the mesh
    listeners (the gateways' own calls) and the stats listener room to accept."""

    # Connections each listener accepts at once; past it Envoy closes new ones at accept.
    # Edge + every mesh listener + stats stays under the overall cap (10,000 by default).
    edge_max_connections: Annotated[int, Field(ge=1, le=10_000_000)] = 5000
    # Per zone's mesh listener: the gateways hold few long-lived HTTP/2 connections there.
    mesh_max_connections: Annotated[int, Field(ge=1, le=10_000_000)] = 2000
    # Prometheus scrapes with one connection at a time.
    stats_max_connections: Annotated[int, Field(ge=1, le=10_000_000)] = 64
    # A TLS handshake not done by then is closed: a client that opens connections and
    # never finishes handshaking holds no slot for long. Loopback handshakes take ms.
    tls_handshake_timeout_ms: Annotated[int, Field(ge=100, le=600_000)] = 5000
    # A request whose headers have not all arrived by then is refused (408): a slow-headers
    # client cannot hold a stream open without ever finishing the request.
    request_headers_timeout_ms: Annotated[int, Field(ge=100, le=600_000)] = 10_000
    # HTTP/2 streams one client connection may have open at the edge: one connection
    # cannot take the gateways' whole breaker (1,024). The mesh listeners serve the
    # gateways' multiplexed calls and keep Envoy's wider setting.
    edge_max_concurrent_streams: Annotated[int, Field(ge=1, le=2_147_483_647)] = 100
    mesh_max_concurrent_streams: Annotated[int, Field(ge=1, le=2_147_483_647)] = 1024


class ShadowSpec(StrictModel):
    """Mirror a share of a model's unpinned calls to another version; Envoy discards the
    mirrored answers, and model servers record both sides for `routes shadow-report`."""

    version: str
    percent: Percent = 100.0


EdgeAuthMode = Literal["off", "basic", "jwt"]
RoleName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]


class EdgeAuth(StrictModel):
    """Who may call through the edge listener (health checks stay open to probes).

    mode `jwt`: callers send `authorization: Bearer <token>`, an ES256 JWT signed by the
    mesh's own key (`servemesh up` creates it under `<state_dir>/auth/`, mode 0600; Envoy
    gets only the public JWKS) with this mesh's issuer and audience, an expiry, and a `role`
    from `roles`; `servemesh auth token --role ROLE` issues one. Envoy's jwt_authn checks it
    and passes the verified role and subject on to the gateway.

    mode `basic`: HTTP basic auth, for local debugging only (Envoy's format is an unsalted
    SHA-1 of the key, and a key carries no role). Without `users`, `servemesh up` creates
    `<state_dir>/edge-credentials` (0600) holding a random key for user `servemesh`.

    mode `off`: no credentials (the local mesh binds loopback only). In every mode the edge
    also accepts, and verifies, an optional client certificate from the mesh CA.

    `enabled: true` is the older spelling of `mode: basic` and keeps meaning that.
    """

    mode: EdgeAuthMode = "off"
    enabled: bool = False
    # htpasswd lines, "name:{SHA}<base64 of sha1(password)>" (mode basic).
    users: list[
        Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}:\{SHA\}[A-Za-z0-9+/]{27}=$")]
    ] = Field(default_factory=list)
    # The roles a token may carry (mode jwt); any other role is refused when issuing.
    roles: list[RoleName] = Field(default_factory=lambda: ["caller", "operator"], min_length=1)
    # Roles whose callers may pin a model version the traffic split gives 0% (a canary).
    pin_roles: list[RoleName] = Field(default_factory=lambda: ["operator"])
    # null: derived from the mesh's name (servemesh.identity.tokens).
    issuer: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    audience: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    max_token_ttl: Duration = "24h"  # `servemesh auth token --ttl` is refused beyond this

    @model_validator(mode="before")
    @classmethod
    def _older_spellings(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("mode") is False:
            # YAML 1.1 reads a bare `off` as false.
            data = {**data, "mode": "off"}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> EdgeAuth:
        if self.enabled and self.mode not in ("off", "basic"):
            raise ValueError(
                f"enabled: true means mode basic; with mode {self.mode} leave enabled out"
            )
        unknown = sorted(set(self.pin_roles) - set(self.roles))
        if unknown:
            raise ValueError(f"pin_roles: {unknown} not among roles {self.roles}")
        return self

    @property
    def active_mode(self) -> EdgeAuthMode:
        """The mode in force (`enabled: true` alone is basic)."""
        if self.mode == "off" and self.enabled:
            return "basic"
        return self.mode


class Overload(StrictModel):
    """Envoy's overload manager: what one Envoy accepts before it sheds.

    Past `max_heap_mb` of heap Envoy stops accepting new requests (and tries to give memory
    back first, at 95%); past `max_downstream_connections` it refuses new connections on
    every listener, so a connection flood cannot exhaust file descriptors or memory."""

    max_heap_mb: Annotated[int, Field(ge=64, le=1_048_576)] = 1024
    max_downstream_connections: Annotated[int, Field(ge=1, le=10_000_000)] = 10_000


class TrafficSpec(StrictModel):
    edge: RoutePolicy = Field(default_factory=_edge_policy)
    edge_hedge: EdgeHedge = Field(default_factory=EdgeHedge)
    rate_limit: RateLimit = Field(default_factory=RateLimit)
    edge_auth: EdgeAuth = Field(default_factory=EdgeAuth)
    feature: RoutePolicy = Field(default_factory=RoutePolicy)
    # Default for every model route and version cluster; a model may override it.
    model: RoutePolicy = Field(default_factory=RoutePolicy)
    overload: Overload = Field(default_factory=Overload)
    edge_streams: EdgeStreams = Field(default_factory=EdgeStreams)
    connections: ConnectionLimits = Field(default_factory=ConnectionLimits)
    # The drill profile: Envoy gets an admin runtime layer, so fault percentages
    # (`fault.<route>.*`) and shadow shares (`shadow.<model>.percent`) can be changed live
    # through the admin API. Off, the admin API refuses every runtime change and only the
    # spec (through `servemesh apply` / `routes`) changes what Envoy does. The chaos drills
    # turn it on for their own meshes; never turn it on for a mesh that serves real traffic.
    runtime_overrides: bool = False

    @model_validator(mode="after")
    def _edge_hedges_are_retries(self) -> TrafficSpec:
        if self.edge_hedge.after_ms and not self.edge.retries.num_retries:
            raise ValueError(
                "edge_hedge.after_ms: needs edge.retries.num_retries of at least 1 (a hedge "
                "is sent as a retry)"
            )
        return self
