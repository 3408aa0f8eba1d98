"""What the mesh tells about itself: request logs (`logs:`), the prediction log
(`prediction_log:`), traces (`tracing:`), metrics (`metrics:`, and the Prometheus targets
written in the state dir), and what its resources cost (`cost:`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from servemesh.spec.base import SpecError, _Strict
from servemesh.spec.durations import Duration, duration_seconds


class LogsSpec(_Strict):
    """What the services write to their JSON logs beyond warnings and errors."""

    # A line per request answered (the gateway's "predict" line with model, version,
    # replica, rows and ms). Off: only refusals, failures and degraded answers are logged
    # per request. Each service follows a change live.
    requests: bool = False


class DriftSpec(_Strict):
    """How the registry watches the live inputs of every model with a drift reference
    (`servemesh drift MODEL --set-reference FILE`), and when a feature counts as drifting.
    docs/operators.md, "Drift on live traffic"."""

    # How often the drift of each referenced model is computed again (its gauges).
    interval: Duration = "1m"
    # The prediction log's rows of the last `window` are compared with the reference.
    window: Duration = "1h"
    # At most this many of the window's newest records (calls) are read per model.
    max_records: Annotated[int, Field(ge=100, le=10_000_000)] = 50_000
    # A feature with fewer live values than this has no verdict (its PSI is mostly noise).
    min_rows: Annotated[int, Field(ge=10, le=1_000_000)] = 200
    # PSI at or above `psi_watch` is a shift worth a look; at or above `psi_drifting`, with
    # the test's p-value under `p_value`, the feature is drifting (and the alert fires).
    psi_watch: Annotated[float, Field(gt=0, le=10)] = 0.1
    psi_drifting: Annotated[float, Field(gt=0, le=10)] = 0.2
    p_value: Annotated[float, Field(gt=0, le=1)] = 0.01
    # How long a feature drifts before ServemeshFeatureDrift fires.
    alert_after: Duration = "15m"

    @model_validator(mode="after")
    def _ordered(self) -> DriftSpec:
        if self.psi_watch > self.psi_drifting:
            raise ValueError("psi_watch: must not be above psi_drifting")
        for name in ("interval", "window"):
            if duration_seconds(getattr(self, name)) <= 0:
                raise ValueError(f"{name}: must be longer than 0")
        return self

    @property
    def interval_s(self) -> float:
        return duration_seconds(self.interval)

    @property
    def window_s(self) -> float:
        return duration_seconds(self.window)


class PredictionLogSpec(_Strict):
    """One record per Predict a gateway answers, kept for `servemesh log query`."""

    enabled: bool = True
    # Records waiting for the writer; past this, new records are dropped (and counted)
    # rather than slowing or failing a request.
    buffer_records: Annotated[int, Field(ge=1, le=10_000_000)] = 10_000
    # The writer flushes every this many ms, or sooner once flush_records are waiting.
    flush_interval_ms: Annotated[float, Field(ge=10, le=600_000)] = 2000.0
    flush_records: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    # Records older than this are deleted, by the writers and by `servemesh log` itself.
    retention: Duration = "7d"
    # PostgreSQL instead of Parquet files under <state_dir>/predictions/: a libpq DSN
    # (keep passwords out of it: use postgres_dsn_file, or ~/.pgpass), or a file whose
    # first line is the DSN.
    postgres_dsn: str | None = None
    postgres_dsn_file: str | None = None
    postgres_table: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_]{0,62}$")] = "predictions"
    # Bounds on what one record keeps of an answer's outputs (as JSON), of its entity ids,
    # and of a status message.
    max_output_bytes: Annotated[int, Field(ge=64, le=1024 * 1024)] = 1024
    max_entity_ids: Annotated[int, Field(ge=1, le=65536)] = 64
    max_message_chars: Annotated[int, Field(ge=16, le=65536)] = 256
    # The feature values a record keeps, as JSON, for a model with `log_features: true`:
    # whole rows, as many as fit.
    max_feature_bytes: Annotated[int, Field(ge=256, le=4 * 1024 * 1024)] = 4096
    # Drift of the live inputs against each model's reference (docs/operators.md).
    drift: DriftSpec = Field(default_factory=DriftSpec)

    @model_validator(mode="after")
    def _one_dsn(self) -> PredictionLogSpec:
        if self.postgres_dsn is not None and self.postgres_dsn_file is not None:
            raise ValueError("postgres_dsn, postgres_dsn_file: give one, not both")
        return self

    @property
    def retention_s(self) -> float:
        return duration_seconds(self.retention)

    def dsn(self) -> str | None:
        """The PostgreSQL DSN (read from postgres_dsn_file at each call); None: Parquet."""
        if self.postgres_dsn_file is None:
            return self.postgres_dsn
        try:
            lines = Path(self.postgres_dsn_file).read_text().splitlines()
        except FileNotFoundError:
            raise SpecError("prediction_log.postgres_dsn_file: no such file") from None
        if not lines or not lines[0].strip():
            raise SpecError("prediction_log.postgres_dsn_file: the first line holds no DSN")
        return lines[0].strip()


# An OTLP/gRPC collector's address: an IP (or localhost) and a port; Envoy's exporter
# cluster takes no other names.
# The embedded trace store's name: its certificate's identity, and its key in
# discovery.hosts where it runs apart (a container of its own).
TRACE_STORE_PART = "tracestore-0"
# An address, or a host name that Envoy resolves itself (a container's, with
# `discovery.backend: dns`: its trace collector cluster is then a DNS cluster).
OtlpEndpoint = Annotated[
    str,
    Field(
        pattern=r"^(localhost|\d{1,3}(\.\d{1,3}){3}|\[[0-9a-fA-F:]+\]"
        r"|[a-zA-Z0-9]([a-zA-Z0-9.-]{0,251}[a-zA-Z0-9])?):\d{1,5}$"
    ),
]


class TraceRetention(_Strict):
    """How long the embedded trace store keeps spans, and how large it may grow."""

    # Spans older than this (by arrival) are deleted.
    max_age: Duration = "24h"
    # Past this size the oldest traces go first, until it fits again.
    max_mb: Annotated[int, Field(ge=1, le=1024 * 1024)] = 256


class TracingSpec(_Strict):
    """OpenTelemetry traces of every hop: services (OTLP) and Envoy (its own tracer).

    Each service names itself by its kind (`service.name`: gateway, feature, model,
    registry) and its instance (`service.instance.id`: e.g. gateway-zone-a-0); Envoy's
    listeners as envoy-edge and envoy-<mesh listener>.
    """

    enabled: bool = True
    # Share of new traces (requests arriving without a trace context) that are recorded.
    # A caller's sampled `traceparent` is honoured (parent-based) within the forced-trace
    # budget below, and an unsampled one never recorded. 1%: an unsampled request costs
    # next to nothing, a sampled one its spans' CPU (docs/observability.md, "Traces"), and
    # 1% of a busy mesh is still many traces a minute; force the rest with
    # `servemesh predict --trace`.
    sample_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.01
    # The forced-trace budget: calls arriving at the edge with a sampled `traceparent`
    # (a caller forcing a trace) are token-bucketed on their own, per caller address and
    # overall; past it such a call is shed with RESOURCE_EXHAUSTED before any service sees
    # it. Calls without a traceparent, or with an unsampled one, never touch it. Raise it
    # for a caller that genuinely traces every call (a bench, a debugging session).
    forced_traces_per_second: Annotated[int, Field(ge=1, le=1_000_000)] = 20
    forced_traces_burst: Annotated[int, Field(ge=1, le=1_000_000)] = 40
    # One caller's share (never more than the overall bucket: a smaller overall one lowers
    # it to match), so a single caller cannot spend the whole budget.
    forced_traces_per_caller_per_second: Annotated[int, Field(ge=1, le=1_000_000)] = 5
    forced_traces_per_caller_burst: Annotated[int, Field(ge=1, le=1_000_000)] = 10
    # An OTLP/gRPC collector (IP:port). null: the embedded trace store `servemesh up`
    # runs (`servemesh trace`).
    otlp_endpoint: OtlpEndpoint | None = None
    # A service sends its finished spans at least this often (BatchSpanProcessor), and so
    # does Envoy's tracer (its flush interval): a sampled trace is whole about this long after
    # its answer.
    export_interval_ms: Annotated[int, Field(ge=10, le=60_000)] = 1000
    retention: TraceRetention = Field(default_factory=TraceRetention)

    @property
    def retention_s(self) -> float:
        return duration_seconds(self.retention.max_age)


class MetricsSpec(_Strict):
    """Metrics: every service's /metrics, the mesh's Prometheus, and what a prediction costs."""

    # auto: `servemesh up` starts a Prometheus (scraping every service and Envoy, with the
    # SLI recording rules) when a `prometheus` binary is on PATH; off: never.
    prometheus: Literal["auto", "off"] = "auto"
    # How often Prometheus scrapes each target (a local mesh: small).
    scrape_interval_s: Annotated[float, Field(ge=0.5, le=300)] = 2.0
    # How long Prometheus keeps samples (its storage lives under the state dir).
    retention: Duration = "1d"
    # auto: beside the mesh's Prometheus, an Alertmanager (when an `alertmanager` or
    # `prometheus-alertmanager` binary is on PATH) routing the SLO and cost alerts by
    # severity to the mesh's own receiver (`servemesh alerts`); off: never.
    alertmanager: Literal["auto", "off"] = "auto"
    # More webhooks per severity (page, ticket) Alertmanager notifies, e.g. a pager's.
    alert_webhooks: dict[
        Literal["page", "ticket"],
        list[Annotated[str, Field(pattern=r"^https?://[^\s]+$", max_length=2048)]],
    ] = Field(default_factory=dict)


class CostSpec(_Strict):
    """What the mesh's resources cost: the cost per million predictions (`servemesh top`,
    `bench predict`) and the capacity plan's cost per hour (`servemesh capacity plan`)."""

    per_core_hour: Annotated[float, Field(ge=0)] = 0.04
    per_gib_hour: Annotated[float, Field(ge=0)] = 0.005
    # Counted only where a model server uses a GPU.
    per_gpu_hour: Annotated[float, Field(ge=0)] = 2.50
    # The cores one replica of a service is given: its price, and the CPU the capacity
    # plan counts its capacity in (a gateway, feature or model server is one event loop).
    cores_per_replica: Annotated[float, Field(gt=0, le=256)] = 1.0
    # The mesh's Prometheus alerts (ServemeshCostPerMillionRising) when a model's cost per
    # million predictions is more than this share above the same hour a week before, for
    # an hour; null: no alert. Needs `metrics.retention` of a week or more to compare.
    alert_weekly_rise: Annotated[float, Field(gt=0, le=100)] | None = 0.25


# Each running stream consumer's /metrics address as a Prometheus file-discovery target,
# in the state dir (servemesh/streams/process.py writes one, the mesh's Prometheus reads them).
STREAM_TARGETS_GLOB = "streams/*.targets.json"
# The scaler's /metrics address, likewise (servemesh/scaling/__main__.py writes it).
SCALER_TARGETS_FILE = "scaling/scaler.targets.json"
