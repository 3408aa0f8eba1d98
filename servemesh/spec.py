"""The mesh spec: one typed, validated description of zones, services, models and policy.

Everything reads it: `servemesh up` starts processes from it, the Envoy renderer writes
config from it, each service finds its port and peers in it. An empty file is a complete
spec: the defaults below are the demo mesh that `servemesh up` runs.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import yaml
from pydantic import (
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from servemesh.demo import DEMO_FEATURES, DEMO_SOURCE_PREFIX
from servemesh.durations import Duration, duration_seconds
from servemesh.errors import ServemeshError
from servemesh.policy import RoutePolicy, ShadowSpec, StrictModel, TrafficSpec
from servemesh.rollout_plan import RolloutSpec
from servemesh.scaling_policy import ScalingSpec

ZoneName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,30}$")]
Name = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]
Port = Annotated[int, Field(ge=0, le=65535)]
ServiceKind = Literal["registry", "model", "feature", "gateway"]
# The kinds whose replicas per zone the scaler sets (servemesh.scaling): every kind but the
# registry. The model servers' count lives in FleetState.per_zone (it predates the others).
ScaledKind = Literal["model", "feature", "gateway"]
SCALED_KINDS: tuple[ScaledKind, ...] = ("model", "gateway", "feature")
# The kinds besides the model servers, whose live counts are FleetState.pools.
FrontKind = Literal["feature", "gateway"]
Spec = TypeVar("Spec", bound="MeshSpec")
Profile = Literal["default", "small-host"]


# The mesh's one registry process.
REGISTRY_INSTANCE = "registry-0"


class SpecError(ServemeshError, ValueError):
    """The mesh spec is malformed; the message names the file and the field."""


_Strict = StrictModel


class Replicas(_Strict):
    """How many processes of a service run in each zone."""

    per_zone: dict[ZoneName, Annotated[int, Field(ge=0, le=16)]] = Field(
        default_factory=lambda: {"zone-a": 1, "zone-b": 1}
    )


class CoalescingSpec(_Strict):
    """The gateway's coalescing: concurrent Predicts for one model and one routing arm share
    one feature read per view and one ModelInfer (services/gateway/coalesce.py)."""

    enabled: bool = True
    # Rows (entities) one shared call carries at most; a Predict with more goes alone.
    max_rows: Annotated[int, Field(ge=1, le=4096)] = 64


class BatchingSpec(_Strict):
    max_batch_size: Annotated[int, Field(ge=1, le=4096)] = 64
    # How long the first request of a batch may wait for company, when no full or
    # preferred batch can be formed.
    max_queue_delay_ms: Annotated[float, Field(ge=0, le=1000)] = 2.0
    preferred_batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    # Requests waiting beyond this are shed with RESOURCE_EXHAUSTED at once.
    max_queue_size: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
    # Rows one request may carry.
    max_rows_per_request: Annotated[int, Field(ge=1, le=65536)] = 1024
    # When a batch that is neither full nor a preferred size leaves:
    #   adaptive      at once while requests do not overlap (a lone caller, sparse traffic:
    #                 few arrive before a batch of one would have finished), so nobody waits
    #                 for company that is not coming; once they overlap, as fixed_window
    #   fixed_window  Triton's rule: up to max_queue_delay_ms after its first request
    dispatch: Literal["adaptive", "fixed_window"] = "adaptive"
    # enforce: each priority level is served earliest deadline first, expired or unmeetable
    #          requests are answered DEADLINE_EXCEEDED without reaching the model, and a
    #          forming batch leaves early for its earliest deadline
    # ignore:  FIFO and deadline-blind, like Triton's default queue policy: every queued
    #          request is computed, even after its caller gave up (for comparisons)
    deadline_policy: Literal["enforce", "ignore"] = "enforce"
    # OIP/Triton priorities: a request's `priority` parameter 1..priority_levels picks a
    # level (1 is served first); 0 or none means default_priority_level.
    priority_levels: Annotated[int, Field(ge=1, le=16)] = 2
    default_priority_level: Annotated[int, Field(ge=1, le=16)] = 1
    # How much lower than the server's the CPU priority of the thread that runs the model is
    # (a nice value added to the server's; 0: the same). Where the model and the server's
    # event loop share a core, 10 lets the loop read requests off the network first, so a
    # compute-bound model's batches fill (11 -> 31 rows, +16-24% req/s at 64 callers)
    # instead of leaving while requests wait unread; but a forward pass that gets a tenth of
    # a saturated core shows in the tail (a protocol-bound model's p99: 32 -> 124 ms). Off
    # by default; docs/benchmarks.md, "With a C client: the model server against Triton,
    # and the model's thread at a lower priority".
    inference_nice: Annotated[int, Field(ge=0, le=19)] = 0

    @model_validator(mode="after")
    def _preferred_fit(self) -> BatchingSpec:
        too_big = [s for s in self.preferred_batch_sizes if s > self.max_batch_size]
        if too_big:
            raise ValueError(f"preferred_batch_sizes: {too_big} exceed max_batch_size")
        if self.default_priority_level > self.priority_levels:
            raise ValueError(
                f"default_priority_level: {self.default_priority_level} is above "
                f"priority_levels ({self.priority_levels})"
            )
        return self


class ModelVersionSpec(_Strict):
    # Where the artifact comes from when the mesh is seeded: "demo:<seed>" builds the demo
    # MLP with that seed, "demo-heavy:<seed>" the compute-bound benchmark MLP (64 -> 2048 ->
    # 2048 -> 1, torch.export); otherwise the version must already be in the registry.
    source: str = "registry"
    # Artificial extra latency per batch (ms): for drills and deadline tests, never in prod.
    inject_latency_ms: Annotated[float, Field(ge=0, le=60_000)] = 0.0


# A model's input or output tensor name, as its signature spells it.
TensorName = Annotated[str, Field(min_length=1, max_length=128)]
FeatureName = Annotated[str, Field(min_length=1, max_length=64)]
# The input name the feature_view/features shorthand fills (the demo models' input).
SHORTHAND_INPUT = "features"


class ModelInputSpec(_Strict):
    """How the gateway fills one input tensor of a model: from a feature view, or with what
    the caller sends (`raw: true`). Exactly one of the two."""

    # The view whose features fill the tensor, one row per entity, in `features`' order.
    view: Name | None = None
    features: Annotated[list[FeatureName], Field(min_length=1, max_length=4096)] | None = None
    # The caller sends the tensor itself (PredictRequest.inputs), rows first.
    raw: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> ModelInputSpec:
        from_view = self.view is not None or self.features is not None
        if self.raw and from_view:
            raise ValueError("raw: an input is raw or read from a view (view, features), not both")
        if not self.raw:
            if self.view is None:
                raise ValueError("view: required (with features), or raw: true")
            if self.features is None:
                raise ValueError(f"features: required with view {self.view!r}")
            if len(set(self.features)) != len(self.features):
                counts = Counter(self.features)
                repeated = sorted(f for f, n in counts.items() if n > 1)
                raise ValueError(f"features: named more than once: {repeated}")
        return self


# Where a precomputed tier's answers come from: `batch.<job>`, a job of the spec's `batch:`
# list scoring this model into redis, or `redis`, whatever `servemesh batch score --model M
# --version V --out redis` wrote for the model. Either way the gateway reads the output of
# the version a request would be routed to, in the feature store's Redis (docs/tiers.md).
PRECOMPUTED_SOURCE = r"^(redis|batch\.[a-z0-9][a-z0-9_-]{0,62})$"


class PrecomputedTierSpec(_Strict):
    """Answers a batch run computed ahead, served while younger than `max_age`."""

    # `from` in the spec (a Python keyword here).
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_by_alias=True,
        validate_by_name=True,
        serialize_by_alias=True,
    )

    source: str = Field(default="redis", alias="from", pattern=PRECOMPUTED_SOURCE)
    max_age: Duration = "26h"

    @property
    def max_age_ms(self) -> int:
        return round(duration_seconds(self.max_age) * 1000)


class CacheTierSpec(_Strict):
    """Answers computed online, kept per gateway (LRU) for `ttl`."""

    ttl: Duration = "10m"
    max_entries: Annotated[int, Field(ge=1, le=10_000_000)] = 100_000
    # How a cached answer is known to be fresh. `read`: each call reads the entity's row
    # first, and a hit needs the row unchanged since the answer (strict; a hit saves the
    # model call only). `feed`: the gateway follows the store's change feed and answers a
    # hit with no call at all; a write reaches it within the feed's delay (about a
    # millisecond), and while the feed is down every call goes the `read` way
    # (docs/tiers.md, "Freshness").
    freshness: Literal["read", "feed"] = "read"

    @property
    def ttl_s(self) -> float:
        return duration_seconds(self.ttl)


class TiersSpec(_Strict):
    """Tiers in front of a model's online path, tried in this order; off when absent. Only
    for the shorthand's entity rows (entity_ids, no caller rows): other calls go online."""

    precomputed: PrecomputedTierSpec | None = None
    cache: CacheTierSpec | None = None


class ModelSpec(_Strict):
    # The shorthand for a model with one input tensor named `features`: the feature view
    # the gateway reads for entity ids, and the feature order the model takes. Ignored (and
    # refused when given) for a model that lists `inputs`.
    feature_view: Name = "user"
    features: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=lambda: list(DEMO_FEATURES), min_length=1, max_length=4096
    )
    # One entry per input tensor of the model, by tensor name (every version of a model
    # takes the same inputs: Envoy's weighted split may pick any of them).
    inputs: dict[TensorName, ModelInputSpec] | None = None
    versions: dict[Name, ModelVersionSpec] = Field(
        default_factory=lambda: {
            "v1": ModelVersionSpec(source=f"{DEMO_SOURCE_PREFIX}1"),
            "v2": ModelVersionSpec(source=f"{DEMO_SOURCE_PREFIX}2"),
        }
    )
    # Share of unpinned traffic per version, in percent; must sum to 100.
    traffic: dict[Name, Annotated[int, Field(ge=0, le=100)]] = Field(
        default_factory=lambda: {"v1": 100, "v2": 0}
    )
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    # Answer with this score and degraded=true when the model or the features are down.
    fallback_score: float | None = None
    # Overrides traffic.model for this model's routes and clusters.
    policy: RoutePolicy | None = None
    shadow: ShadowSpec | None = None
    # Precomputed and cached answers in front of the online path (docs/tiers.md); off.
    tiers: TiersSpec | None = None

    @model_validator(mode="after")
    def _inputs_or_shorthand(self) -> ModelSpec:
        if self.inputs is None:
            return self
        if not self.inputs:
            raise ValueError("inputs: give at least one input tensor")
        both = sorted({"feature_view", "features"} & self.model_fields_set)
        if both:
            raise ValueError(
                f"{', '.join(both)}: the shorthand for one input named {SHORTHAND_INPUT!r}; "
                "a model that lists inputs names its views there"
            )
        return self

    @model_serializer(mode="wrap")
    def _without_unused_shorthand(self, handler: SerializerFunctionWrapHandler) -> object:
        # A model with `inputs` does not write the shorthand's defaults: read back, they
        # would look like a second, conflicting description of its inputs.
        data = handler(self)
        if self.inputs is not None and isinstance(data, dict):
            data.pop("feature_view", None)
            data.pop("features", None)
        return data

    @property
    def effective_inputs(self) -> dict[str, ModelInputSpec]:
        """Every input tensor of the model by name, how it is filled: `inputs` as listed, or
        the shorthand's one input named `features` read from `feature_view`."""
        if self.inputs is not None:
            return dict(self.inputs)
        # Built on every call (the gateway asks per request): the shorthand's fields were
        # validated with the model, so it is constructed without validating them again.
        shorthand = ModelInputSpec.model_construct(view=self.feature_view, features=self.features)
        return {SHORTHAND_INPUT: shorthand}

    @property
    def views(self) -> list[str]:
        """The feature views the model reads, in the order its inputs first name them."""
        found: list[str] = []
        for spec in self.effective_inputs.values():
            if spec.view is not None and spec.view not in found:
                found.append(spec.view)
        return found

    @model_validator(mode="after")
    def _traffic_names_known_versions(self) -> ModelSpec:
        unknown = sorted(set(self.traffic) - set(self.versions))
        if unknown:
            raise ValueError(
                f"traffic: names unknown versions {unknown}; known: {sorted(self.versions)}"
            )
        total = sum(self.traffic.values())
        if total != 100:
            raise ValueError(f"traffic: weights must sum to 100, got {total}")
        if self.shadow is not None and self.shadow.version not in self.versions:
            raise ValueError(
                f"shadow.version: unknown version {self.shadow.version!r}; "
                f"known: {sorted(self.versions)}"
            )
        return self


class Limits(_Strict):
    # gRPC messages above this are refused with RESOURCE_EXHAUSTED by every service.
    max_message_bytes: Annotated[int, Field(ge=1024, le=256 * 1024 * 1024)] = 4 * 1024 * 1024
    # Registry uploads above this are refused.
    max_artifact_bytes: Annotated[int, Field(ge=1024, le=16 * 1024**3)] = 512 * 1024 * 1024
    # Bytes the registry stores in all (distinct artifacts); an upload that would pass it is
    # refused before its bytes arrive.
    registry_quota_bytes: Annotated[int, Field(ge=1024, le=1024**5)] = 8 * 1024**3
    # An upload that sends no message for this long is aborted (DEADLINE_EXCEEDED), and
    # leaves nothing behind.
    upload_idle_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # Entities plus rows in one Predict.
    max_rows_per_predict: Annotated[int, Field(ge=1, le=65536)] = 1024
    # Feature names one GetFeatures may ask for, and entities x features it may read.
    max_feature_names: Annotated[int, Field(ge=1, le=65536)] = 1024
    max_feature_cells: Annotated[int, Field(ge=1, le=64 * 1024 * 1024)] = 1024 * 1024


class Deadlines(_Strict):
    # Time each hop keeps for itself (answering, serialising) before calling downstream.
    hop_budget_ms: Annotated[float, Field(ge=0, le=1000)] = 2.0
    # Deadline applied to calls that arrive without one.
    default_timeout_ms: Annotated[float, Field(gt=0, le=600_000)] = 5000.0


class FeatureViewSpec(_Strict):
    """One feature view: what a loaded row of it holds, and when a stored row is too old.

    `servemesh features load FILE --view NAME --key COLUMN` replaces the view with the file
    (docs/features.md); the feature service reads it for the models that name it.
    """

    # The entity the view is keyed by (a request names an id per entity); null: the view's
    # own name. Views of one entity share its ids.
    entity: Name | None = None
    # The features of a row, in the order they are stored and served; a file loaded into
    # the view has exactly these columns besides its key (and timestamp), in any order.
    # null: the view takes every other column of the file it is loaded from, in the
    # file's order (each load may change them).
    features: list[FeatureName] | None = None
    # A row older than this, by its event time (the file's --timestamp column, else the
    # time it was loaded), is stale. null: rows never go stale.
    max_age: Duration | None = None
    # What a read of a stale row answers:
    #   error     FAILED_PRECONDITION naming the entity and its age
    #   default   the view's defaults, with `defaulted` and `stale` set
    #   degraded  the stored values, with `stale` set for the gateway to surface
    staleness: Literal["error", "default", "degraded"] = "error"
    # May a loaded value be NaN (an empty cell loads as NaN)? Infinities never load.
    allow_nan: bool = False
    # Values answered for a missing entity (feature_store.missing_entity: defaults) or a
    # stale one (staleness: default), per feature; the rest get feature_store.default_value.
    defaults: dict[FeatureName, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> FeatureViewSpec:
        if self.features is not None:
            repeated = sorted({f for f in self.features if self.features.count(f) > 1})
            if repeated:
                raise ValueError(f"features: named more than once: {repeated}")
            if not self.features:
                raise ValueError("features: give at least one, or null for the file's columns")
            unknown = sorted(set(self.defaults) - set(self.features))
            if unknown:
                raise ValueError(f"defaults: not features of the view: {unknown}")
        if self.max_age is not None and duration_seconds(self.max_age) <= 0:
            raise ValueError("max_age: must be longer than 0 (null: rows never go stale)")
        return self

    @property
    def max_age_ms(self) -> int | None:
        """max_age in milliseconds; None when rows never go stale."""
        if self.max_age is None:
            return None
        return round(duration_seconds(self.max_age) * 1000)


def _demo_views() -> dict[str, FeatureViewSpec]:
    return {"user": FeatureViewSpec(features=list(DEMO_FEATURES))}


class FeatureStoreSpec(_Strict):
    # None: `servemesh up` starts its own redis-server on a free port, with a password.
    # The URL is printed (endpoints.json, the resolved spec): never put a password in it.
    redis_url: str | None = None
    # A file whose first line is the Redis password (keep it owner-only). The launcher's
    # own Redis always has one: `<state_dir>/redis-password`, set when the spec resolves.
    password_file: str | None = None
    # What to do with an entity missing from the store: "error" answers NOT_FOUND naming
    # it; "defaults" answers the view's default values with `defaulted` set.
    missing_entity: Literal["error", "defaults"] = "error"
    default_value: float = 0.0
    key_prefix: Annotated[str, Field(min_length=1, max_length=64)] = "fs"


class DemoSpec(_Strict):
    # Seed the registry with the demo models and Redis with demo features on `up`.
    enabled: bool = True
    entities: Annotated[int, Field(ge=0, le=1_000_000)] = 5000


class NetworkSpec(_Strict):
    """How the zones are networked on this machine."""

    # loopback: every process shares the machine's loopback (the default).
    # netns:    each zone's gateway, feature and model processes run in a network
    #           namespace of their own (root; `servemesh up --netns`), so a partition can
    #           cut one zone off another; every address stays on loopback (NAT carries it)
    #           and Envoy's clusters for a zone send from that zone's own loopback source.
    mode: Literal["loopback", "netns"] = "loopback"


# The Envoy that holds the edge listener: the mesh's only one in the shared layout, and the
# edge's own in the per-zone layout, where each zone's Envoy is named by its zone. The name
# keeps the admin socket, config and log paths the shared layout has always had.
EDGE_PROXY = "envoy"


class ProxySpec(_Strict):
    """How the mesh's Envoy is laid out over processes (docs/architecture.md, "Zones").

    per_zone: the edge is an Envoy of its own, and each zone has its own, holding that
              zone's mesh listener and clusters; one Envoy's crash, or a config it refuses,
              takes out its own zone (or the edge), not every zone at once. The default:
              no process spans two zones.
    shared:   one Envoy holds the edge listener and every zone's mesh listener: about
              140 MiB less memory for a two-zone mesh, and one failure domain for all.
    """

    layout: Literal["shared", "per_zone"] = "per_zone"


class TlsSpec(_Strict):
    """Certificates. Every hop inside the mesh is mutual TLS with certificates from a CA
    that `servemesh up` creates under <state_dir>/tls; there is no switch for that."""

    # The edge listener serves TLS (false: plaintext, for local debugging only).
    edge: bool = True
    # More DNS names or IP addresses the edge certificate carries (besides localhost,
    # 127.0.0.1 and ::1), for callers that reach the edge by another name.
    edge_names: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list, max_length=64
    )
    # Life of each service certificate; `up` renews one with a third of its life left, and
    # `servemesh certs rotate` replaces them on a running mesh.
    leaf_days: Annotated[int, Field(ge=1, le=825)] = 30


class LogsSpec(_Strict):
    """What the services write to their JSON logs beyond warnings and errors."""

    # A line per request answered (the gateway's "predict" line with model, version,
    # replica, rows and ms). Off: only refusals, failures and degraded answers are logged
    # per request. Each service follows a change live.
    requests: bool = False


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
OtlpEndpoint = Annotated[
    str, Field(pattern=r"^(localhost|\d{1,3}(\.\d{1,3}){3}|\[[0-9a-fA-F:]+\]):\d{1,5}$")
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


# The name `discovery.hosts` gives the edge's Envoy by (the shared layout's only one; every
# other part is named by its instance, a zone's Envoy by proxy_part).
ENVOY_PART = "envoy"


def proxy_part(proxy: str) -> str:
    """The name of one of the mesh's Envoys (spec.proxies()) as a part of the mesh: in
    `discovery.hosts`, as a process of the launcher's, as a Prometheus instance. `envoy` for
    the edge's (the shared layout's only one), `envoy-<zone>` for a zone's."""
    return ENVOY_PART if proxy == EDGE_PROXY else f"{ENVOY_PART}-{proxy}"


class DiscoverySpec(_Strict):
    """Where Envoy finds the service instances, and where the parts listen and are reached."""

    # file:   the spec's instances at their ports (what `servemesh up` runs).
    # consul: every service registers itself in Consul with a gRPC health check over
    #         mutual TLS, and leaves on drain; `servemesh control-plane` turns the catalog's
    #         passing instances into Envoy's endpoint files (docs/multihost.md).
    backend: Literal["file", "consul"] = "file"
    # The Consul agent's HTTP API, host:port (plain HTTP: run the agent beside the services).
    consul_address: Annotated[str, Field(pattern=r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")] = (
        "127.0.0.1:8500"
    )
    # A file whose first line is the Consul ACL token (null: no token).
    consul_token_file: str | None = None
    # How often Consul health-checks each instance, and how long one may fail its checks
    # before Consul removes it (a replica that died without draining).
    check_interval_s: Annotated[float, Field(ge=0.5, le=300)] = 2.0
    deregister_after: Duration = "1m"
    # The address services and Envoy bind; null: `host`. 0.0.0.0 inside a container,
    # whose peers are other containers (every port still takes mesh certificates only).
    listen_host: str | None = None
    # Where a part is reached when it is not on `host`: instance name (or "envoy") to a
    # host name or address, e.g. each container's name in docker-compose.yml.
    hosts: dict[str, Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=dict
    )


class Ports(_Strict):
    """Fixed listening ports; 0 picks a free port at start (what the tests use)."""

    edge: Port = 8080
    # The first zone's mesh listener; zone i listens on mesh + i.
    mesh: Port = 8081
    # Kept so older spec files still load; used only as Envoy's --base-id. Envoy's admin API
    # listens on no TCP port: it is the Unix socket <state_dir>/admin/envoy.sock, in a
    # directory of mode 0700 (servemesh.proxy.admin.admin_socket_path).
    envoy_admin: Port = 9901
    # Services take consecutive ports from here, in the order `instances()` lists them.
    services_base: Port = 50051
    # Envoy's stats as Prometheus text (GET /stats/prometheus, loopback; nothing else of
    # the admin API is reachable there).
    envoy_stats: Port = 9902
    # The mesh's Prometheus (metrics.prometheus); 9090, Prometheus's own default, is left
    # to a Prometheus of the machine's.
    prometheus: Port = 9190

    @classmethod
    def free(cls) -> Ports:
        """Every port picked free at start: a mesh that runs beside others (tests, drills,
        benchmarks)."""
        return cls(edge=0, mesh=0, envoy_admin=0, services_base=0)

    @model_validator(mode="before")
    @classmethod
    def _free_with_the_edge(cls, data: object) -> object:
        # A mesh on free ports (edge: 0, as tests and drills run several at once) gets free
        # metrics ports too, unless it names them.
        if isinstance(data, dict) and data.get("edge") == 0:
            data = {"envoy_stats": 0, "prometheus": 0, **data}
        return data


class MetricsSpec(_Strict):
    """Metrics: every service's /metrics, the mesh's Prometheus, and what a prediction costs."""

    # auto: `servemesh up` starts a Prometheus (scraping every service and Envoy, with the
    # SLI recording rules) when a `prometheus` binary is on PATH; off: never.
    prometheus: Literal["auto", "off"] = "auto"
    # How often Prometheus scrapes each target (a local mesh: small).
    scrape_interval_s: Annotated[float, Field(ge=0.5, le=300)] = 2.0
    # How long Prometheus keeps samples (its storage lives under the state dir).
    retention: Duration = "1d"


class RegistryBackupSpec(_Strict):
    """Scheduled backups of the registry's store, taken by the registry process itself
    (`servemesh registry backup` takes one by hand; docs/registry.md)."""

    # How often; null: never on a schedule.
    interval: Duration | None = None
    # Where the snapshots and artifacts go; null: <state_dir>/registry-backups.
    directory: str | None = None
    # The newest this many snapshots are kept (and the artifacts they name).
    keep: Annotated[int, Field(ge=1, le=10_000)] = 7

    @property
    def interval_s(self) -> float | None:
        return None if self.interval is None else duration_seconds(self.interval)


class RegistrySpec(_Strict):
    backup: RegistryBackupSpec = Field(default_factory=RegistryBackupSpec)


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


# Where the prices lived before `cost:` existed; a spec that still sets them there means
# the same (moved by MeshSpec).
_OLD_PRICE_KEYS = {"price_per_core_hour": "per_core_hour", "price_per_gpu_hour": "per_gpu_hour"}


class SandboxSpec(_Strict):
    # The user model servers run as when `servemesh up` runs as root (a model file is code):
    # auto: uid/gid 61000; off: root, like the rest; or a uid, uid:gid or user name.
    # Not root, every process is the mesh's user (servemesh.procs.sandbox).
    model_user: str = "auto"


# A Redis stream key (a consumer reads one and writes two).
StreamKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9:._{}-]{0,199}$")]


class StreamSpec(_Strict):
    """One streaming prediction: a consumer group reading events from a Redis stream,
    writing one prediction per event to an output stream (`servemesh stream`,
    docs/serving-patterns.md). Delivery is at least once with an idempotent effect: an
    event is acknowledged only after its prediction is written, and a redelivered event
    never adds a second output entry."""

    name: Name
    # The model that scores each event; `version` pins one (through the mesh, a pin at 0%
    # of traffic is refused unless the caller is an operator); null: the routes decide
    # (mesh), or the version with the most traffic (in_process).
    model: Name
    version: Name | None = None
    # mesh: each batch is one Predict through the edge (routing, canaries, deadlines and
    # the prediction log apply); in_process: the consumer loads the registry's verified
    # artifact itself and reads the views straight from the feature store.
    mode: Literal["mesh", "in_process"] = "mesh"
    # The stream keys; null: streams:<name>:in, :out and :dead.
    input: StreamKey | None = None
    output: StreamKey | None = None
    dead_letter: StreamKey | None = None
    group: Name = "servemesh"
    # Where the streams live; null: the mesh's own Redis (feature_store.redis_url).
    redis_url: str | None = None
    # A file whose first line is that Redis's password (with redis_url).
    password_file: str | None = None
    # A new group starts at the stream's first entry (earliest) or at its end (latest).
    start: Literal["earliest", "latest"] = "earliest"
    # Events read (and scored) per batch, and how long a read waits for one.
    batch_size: Annotated[int, Field(ge=1, le=10_000)] = 64
    block_ms: Annotated[int, Field(ge=1, le=60_000)] = 100
    # Another consumer's pending entry idle this long is taken over (a consumer that died).
    claim_min_idle: Duration = "30s"
    # How long the marker that an event's prediction was written is kept: a redelivery
    # later than this would write a second output entry.
    dedup_ttl: Duration = "1d"
    # The deadline of each Predict (mesh) or batch (in_process).
    deadline_ms: Annotated[float, Field(gt=0, le=600_000)] = 2000.0
    # The output and dead-letter streams are trimmed to about this many entries.
    max_output_entries: Annotated[int, Field(ge=1000, le=1_000_000_000)] = 1_000_000

    @property
    def input_key(self) -> str:
        return self.input or f"streams:{self.name}:in"

    @property
    def output_key(self) -> str:
        return self.output or f"streams:{self.name}:out"

    @property
    def dead_letter_key(self) -> str:
        return self.dead_letter or f"streams:{self.name}:dead"


# The cron macros a batch job's schedule may be (else five fields: minute hour day month
# weekday, in UTC).
CRON_MACROS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


class BatchJobSpec(_Strict):
    """One scheduled batch run: `servemesh batch score` with these arguments, run when its
    cron `schedule` (UTC) comes round, by `servemesh batch run-due` or by `servemesh up`
    (docs/batch.md)."""

    name: Name
    model: Name
    # The model version, or a registry alias naming one; neither: the version most traffic
    # goes to when the job runs.
    version: Name | None = None
    alias: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    # Score every entity of this view (default: the model's first), or the ids in this CSV
    # or Parquet file (relative paths: to the directory the command runs in).
    view: Name | None = None
    entities: Annotated[str, Field(min_length=1)] | None = None
    entity_column: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    # FILE.parquet, redis (the mesh's own, docs/batch.md's key layout) or postgresql://...
    output: Annotated[str, Field(min_length=1)]
    # The PostgreSQL table (default <model>_scores).
    table: Annotated[str, Field(min_length=1, max_length=63)] | None = None
    chunk_rows: Annotated[int, Field(ge=1, le=65_536)] = 1024
    # Score only rows that pass, e.g. "event_ts > 2024-05-01 and f03 >= 0.5".
    where: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # Cron, five fields (minute hour day-of-month month day-of-week) or a macro (@daily).
    schedule: str
    # torch intra-op threads for the run (null: torch's default).
    threads: Annotated[int, Field(ge=1, le=1024)] | None = None

    @field_validator("schedule")
    @classmethod
    def _cron(cls, schedule: str) -> str:
        from croniter import croniter

        text = " ".join(schedule.split())
        if not text.startswith("@") and len(text.split()) != 5:
            raise ValueError(
                f"{schedule!r}: five cron fields (minute hour day month weekday) or one of "
                f"{', '.join(CRON_MACROS)}"
            )
        if text.startswith("@") and text not in CRON_MACROS:
            raise ValueError(f"{schedule!r}: not one of {', '.join(CRON_MACROS)}")
        if not croniter.is_valid(text):
            raise ValueError(f"{schedule!r}: not a valid cron expression")
        return text

    @model_validator(mode="after")
    def _one_of_each(self) -> BatchJobSpec:
        if self.version is not None and self.alias is not None:
            raise ValueError("version, alias: give one, not both")
        if self.view is not None and self.entities is not None:
            raise ValueError("view, entities: give one, not both")
        postgres = self.output.startswith(("postgresql://", "postgres://"))
        if (
            not postgres
            and self.output != "redis"
            and not self.output.endswith((".parquet", ".pq"))
        ):
            raise ValueError(
                f"output: {self.output!r} is not a .parquet file, redis or postgresql://"
            )
        if self.table is not None and not postgres:
            raise ValueError("table: only with a postgresql:// output")
        if self.entity_column is not None and self.entities is None:
            raise ValueError("entity_column: only with entities")
        return self


DEFAULT_ZONES = ("zone-a", "zone-b")


def profile_preset(profile: Profile, zones: Sequence[str]) -> dict[str, dict[str, object]]:
    """What a profile sets for each section the spec leaves out (a section the spec gives
    keeps the fields it names).

    default:    one gateway, one feature and one model process in every zone, and an Envoy
                per zone besides the edge's: no process spans two zones.
    small-host: a gateway in every zone, but one feature and one model process, in the
                first zone, serving every zone, and one Envoy holding the edge and every
                zone's listener and clusters. The zones stay in Envoy's config (each
                zone's gateway, mesh listener, localities and failover), so routes, weights
                and tools read the same in both."""
    if profile not in get_args(Profile):
        raise ValueError(f"profile: {profile!r} is not one of {list(get_args(Profile))}")
    every_zone = {zone: 1 for zone in zones}
    small_host = profile == "small-host"
    shared_processes = {zones[0]: 1} if small_host else every_zone
    return {
        "gateway": {"per_zone": every_zone},
        "feature": {"per_zone": shared_processes},
        "model_servers": {"per_zone": shared_processes},
        "proxy": {"layout": "shared" if small_host else "per_zone"},
    }


def with_profile(spec: Spec, profile: Profile) -> Spec:
    """`spec` moved to `profile`: its feature and model processes and its Envoy layout as the
    profile presets them (what `servemesh bench layout` compares); the rest as it was. A
    declared spec only: a running mesh's (ResolvedSpec) has ports for the processes it runs."""
    if isinstance(spec, ResolvedSpec):
        raise TypeError("with_profile takes a declared spec, not a running mesh's")
    data = spec.model_dump(mode="json")
    for section in ("feature", "model_servers", "proxy"):
        data.pop(section)
    return type(spec).model_validate({**data, "profile": profile})


class MeshSpec(_Strict):
    name: Name = "servemesh"
    host: str = "127.0.0.1"
    # default:    every zone runs its own gateway, feature and model processes and its own
    #             Envoy: no process spans two zones, so a zone's failure stays its own.
    # small-host: one machine of a few cores serving every zone (profile_preset): less
    #             memory and idle CPU (docs/benchmarks.md); a drill that takes one zone's
    #             own feature or model processes away needs the default profile.
    profile: Profile = "default"
    zones: list[ZoneName] = Field(default_factory=lambda: list(DEFAULT_ZONES), min_length=1)
    ports: Ports = Field(default_factory=Ports)
    state_dir: str = ".servemesh"
    gateway: Replicas = Field(default_factory=Replicas)
    feature: Replicas = Field(default_factory=Replicas)
    model_servers: Replicas = Field(default_factory=Replicas)
    models: dict[Name, ModelSpec] = Field(default_factory=lambda: {"fraud": ModelSpec()})
    # The feature views of the online store; every model's feature_view names one.
    feature_views: dict[Name, FeatureViewSpec] = Field(default_factory=_demo_views)
    feature_store: FeatureStoreSpec = Field(default_factory=FeatureStoreSpec)
    traffic: TrafficSpec = Field(default_factory=TrafficSpec)
    limits: Limits = Field(default_factory=Limits)
    deadlines: Deadlines = Field(default_factory=Deadlines)
    demo: DemoSpec = Field(default_factory=DemoSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    proxy: ProxySpec = Field(default_factory=ProxySpec)
    tls: TlsSpec = Field(default_factory=TlsSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    prediction_log: PredictionLogSpec = Field(default_factory=PredictionLogSpec)
    logs: LogsSpec = Field(default_factory=LogsSpec)
    # How the gateways share feature reads and model calls between concurrent Predicts.
    coalescing: CoalescingSpec = Field(default_factory=CoalescingSpec)
    tracing: TracingSpec = Field(default_factory=TracingSpec)
    discovery: DiscoverySpec = Field(default_factory=DiscoverySpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    # Streaming predictions: one consumer process per entry, started by `servemesh up`.
    streams: list[StreamSpec] = Field(default_factory=list, max_length=64)
    # Scheduled batch runs (docs/batch.md): `servemesh batch run-due`, or `servemesh up`.
    batch: list[BatchJobSpec] = Field(default_factory=list, max_length=64)
    # The scaler `servemesh up` runs: model servers per zone follow the traffic between the
    # policy's bounds (docs/capacity.md).
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    cost: CostSpec = Field(default_factory=CostSpec)
    # The model registry's own settings (its size limits are in `limits`).
    registry: RegistrySpec = Field(default_factory=RegistrySpec)

    @model_validator(mode="before")
    @classmethod
    def _profile_fills_what_the_spec_leaves_out(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        profile = data.get("profile", "default")
        zones = data.get("zones", DEFAULT_ZONES)
        if profile not in get_args(Profile) or not isinstance(zones, list | tuple) or not zones:
            return data  # the fields' own checks say what is wrong
        filled = dict(data)
        for section, preset in profile_preset(profile, [str(z) for z in zones]).items():
            given = filled.get(section)
            if given is None:
                filled[section] = preset
            elif isinstance(given, dict):
                filled[section] = {**preset, **given}
            # A section given as a model object is the spec's own, whole.
        return filled

    @model_validator(mode="before")
    @classmethod
    def _prices_moved_to_cost(cls, data: object) -> object:
        metrics = data.get("metrics") if isinstance(data, dict) else None
        if not isinstance(metrics, dict) or not set(metrics) & set(_OLD_PRICE_KEYS):
            return data
        assert isinstance(data, dict)
        cost = dict(data.get("cost") or {})
        metrics = dict(metrics)
        for old, new in _OLD_PRICE_KEYS.items():
            if old in metrics:
                if new in cost:
                    raise ValueError(f"metrics.{old} and cost.{new} both set: keep cost.{new}")
                cost[new] = metrics.pop(old)
        return {**data, "metrics": metrics, "cost": cost}

    @field_validator("host")
    @classmethod
    def _loopback_only(cls, host: str) -> str:
        if host not in {"127.0.0.1", "localhost", "::1"} and not host.startswith("127."):
            raise ValueError("host must be a loopback address (the local mesh binds nothing else)")
        return host

    @model_validator(mode="after")
    def _small_host_serves_every_zone_from_the_first(self) -> MeshSpec:
        if self.profile != "small-host":
            return self
        first = self.zones[0]
        for service in ("feature", "model_servers"):
            replicas: Replicas = getattr(self, service)
            elsewhere = sorted(z for z, n in replicas.per_zone.items() if n and z != first)
            if elsewhere:
                raise ValueError(
                    f"{service}.per_zone: profile small-host runs the {service} processes in "
                    f"the first zone ({first}) for every zone, not in {elsewhere}; leave "
                    f"{service} out of the spec, or use profile: default (a running mesh "
                    "changes its profile only when it starts again)"
                )
        return self

    @model_validator(mode="after")
    def _replicas_in_known_zones(self) -> MeshSpec:
        for service in ("gateway", "feature", "model_servers"):
            replicas: Replicas = getattr(self, service)
            unknown = sorted(set(replicas.per_zone) - set(self.zones))
            if unknown:
                raise ValueError(f"{service}.per_zone: names unknown zones {unknown}")
            if sum(replicas.per_zone.values()) < 1:
                raise ValueError(f"{service}.per_zone: needs at least one replica")
        return self

    @model_validator(mode="after")
    def _replicas_within_the_scaling_bounds(self) -> MeshSpec:
        if not self.scaling.enabled:
            return self
        for kind in SCALED_KINDS:
            policy = self.scaling.pool(kind)
            field_name = replicas_field(kind)
            for zone, count in sorted(self.declared_replicas(kind).per_zone.items()):
                # A zone with none of a kind is no pool: the scaler leaves it empty.
                if count and not policy.min <= count <= policy.max:
                    raise ValueError(
                        f"{field_name}.per_zone.{zone}: {count} is outside the scaler's "
                        f"bounds scaling.{field_name}.min {policy.min} .. max {policy.max}"
                    )
        return self

    def declared_replicas(self, kind: ScaledKind) -> Replicas:
        """The spec's replicas per zone of a kind (`gateway`, `feature`, `model_servers`)."""
        found: Replicas = getattr(self, replicas_field(kind))
        return found

    def replicas_of(self, kind: ScaledKind) -> Replicas:
        """Replicas per zone of a kind as they run (a declared spec: as declared)."""
        return self.declared_replicas(kind)

    @property
    def registry_backup_dir(self) -> Path:
        """Where the registry's backups go (`registry.backup.directory`)."""
        given = self.registry.backup.directory
        return Path(given) if given else Path(self.state_dir) / "registry-backups"

    @property
    def registry_store_dir(self) -> Path:
        """The registry's store: metadata and artifacts (registry/store.py)."""
        return Path(self.state_dir) / "registry"

    def proxies(self) -> list[str]:
        """The mesh's Envoys by name: the edge's (EDGE_PROXY) first, then, in the per-zone
        layout, one per zone, named by its zone."""
        return [EDGE_PROXY] + (list(self.zones) if self.proxy.layout == "per_zone" else [])

    def proxy_of_zone(self, zone: str) -> str:
        """The Envoy holding `zone`'s mesh listener and clusters."""
        return zone if self.proxy.layout == "per_zone" else EDGE_PROXY

    def scaled_zones(self, kind: ScaledKind = "model") -> list[str]:
        """The zones whose replicas of `kind` the scaler manages: those the spec gives any."""
        declared = self.declared_replicas(kind).per_zone
        return [z for z in self.zones if declared.get(z, 0) > 0]

    @model_validator(mode="after")
    def _hosts_name_known_parts(self) -> MeshSpec:
        envoys = {proxy_part(proxy) for proxy in self.proxies()}
        known = {i.name for i in self.instances()} | envoys
        unknown = sorted(set(self.discovery.hosts) - known)
        if unknown:
            raise ValueError(
                f"discovery.hosts: names no instance or Envoy ({sorted(envoys)}): {unknown}"
            )
        return self

    @model_validator(mode="after")
    def _models_read_known_views(self) -> MeshSpec:
        for name, model in self.models.items():
            for tensor, spec in model.effective_inputs.items():
                if spec.view is None or spec.features is None:
                    continue
                # The shorthand's errors name its own fields.
                where = (
                    f"models.{name}" if model.inputs is None else f"models.{name}.inputs.{tensor}"
                )
                view_field = "feature_view" if model.inputs is None else "view"
                view = self.feature_views.get(spec.view)
                if view is None:
                    raise ValueError(
                        f"{where}.{view_field}: {spec.view!r} is not one of "
                        f"feature_views {sorted(self.feature_views)}"
                    )
                if view.features is not None:
                    lacking = [f for f in spec.features if f not in set(view.features)]
                    if lacking:
                        raise ValueError(
                            f"{where}.features: not in feature view {spec.view!r}: {lacking[:10]}"
                        )
        return self

    @model_validator(mode="after")
    def _streams_name_known_models(self) -> MeshSpec:
        names = [s.name for s in self.streams]
        twice = sorted(n for n, count in Counter(names).items() if count > 1)
        if twice:
            raise ValueError(f"streams: names used more than once: {twice}")
        for i, stream in enumerate(self.streams):
            model = self.models.get(stream.model)
            if model is None:
                raise ValueError(
                    f"streams[{i}].model: {stream.model!r} is not one of models "
                    f"{sorted(self.models)}"
                )
            if stream.version is not None and stream.version not in model.versions:
                raise ValueError(
                    f"streams[{i}].version: {stream.version!r} is not a version of "
                    f"{stream.model!r}: {sorted(model.versions)}"
                )
            keys = [stream.input_key, stream.output_key, stream.dead_letter_key]
            if len(set(keys)) != 3:
                raise ValueError(f"streams[{i}]: input, output and dead_letter must differ")
            if stream.password_file is not None and stream.redis_url is None:
                raise ValueError(f"streams[{i}].password_file: only with redis_url")
        return self

    @model_validator(mode="after")
    def _batch_jobs_name_known_models(self) -> MeshSpec:
        names = [j.name for j in self.batch]
        twice = sorted(n for n, count in Counter(names).items() if count > 1)
        if twice:
            raise ValueError(f"batch: names used more than once: {twice}")
        for i, job in enumerate(self.batch):
            model = self.models.get(job.model)
            if model is None:
                raise ValueError(
                    f"batch[{i}].model: {job.model!r} is not one of models {sorted(self.models)}"
                )
            if job.version is not None and job.version not in model.versions:
                raise ValueError(
                    f"batch[{i}].version: {job.version!r} is not a version of "
                    f"{job.model!r}: {sorted(model.versions)}"
                )
            if job.view is not None and job.view not in model.views:
                raise ValueError(
                    f"batch[{i}].view: model {job.model!r} reads {model.views}, not {job.view!r}"
                )
        return self

    @model_validator(mode="after")
    def _precomputed_tiers_name_redis_jobs(self) -> MeshSpec:
        for name, model in self.models.items():
            tier = model.tiers.precomputed if model.tiers else None
            if tier is None or not tier.source.startswith("batch."):
                continue
            job_name = tier.source.removeprefix("batch.")
            where = f"models.{name}.tiers.precomputed.from"
            job = next((j for j in self.batch if j.name == job_name), None)
            if job is None:
                known = [j.name for j in self.batch]
                raise ValueError(f"{where}: no batch job named {job_name!r}; known: {known}")
            if job.model != name or job.output != "redis":
                raise ValueError(
                    f"{where}: batch job {job_name!r} scores {job.model!r} into {job.output!r}; "
                    f"the tier reads a job scoring {name!r} into redis"
                )
        return self

    def batch_job(self, name: str) -> BatchJobSpec:
        for job in self.batch:
            if job.name == name:
                return job
        known = [j.name for j in self.batch]
        raise SpecError(f"no batch job named {name!r} in the spec's batch; known: {known}")

    def stream(self, name: str) -> StreamSpec:
        for stream in self.streams:
            if stream.name == name:
                return stream
        known = [s.name for s in self.streams]
        raise SpecError(f"no stream named {name!r} in the spec's streams; known: {known}")

    def entity_of(self, view: str) -> str:
        """The entity `view` is keyed by: its `entity`, else its own name."""
        spec = self.feature_views.get(view)
        if spec is None:
            raise SpecError(f"no feature view named {view!r}; views: {sorted(self.feature_views)}")
        return spec.entity or view

    def entities_of(self, model: ModelSpec) -> list[str]:
        """The entities whose ids a request for `model` names, in the order its views are read."""
        found: list[str] = []
        for view in model.views:
            entity = self.entity_of(view)
            if entity not in found:
                found.append(entity)
        return found

    # --- derived views -------------------------------------------------------------

    def instances(self) -> list[Instance]:
        """Every service process of the mesh, in start order (registry first)."""
        found = [Instance(name=REGISTRY_INSTANCE, service="registry", zone=self.zones[0])]
        found += self._model_instances()
        kinds: tuple[FrontKind, ...] = ("feature", "gateway")
        for service in kinds:
            replicas = self.replicas_of(service)
            for zone in self.zones:
                for index in range(replicas.per_zone.get(zone, 0)):
                    found.append(
                        Instance(
                            name=instance_name(service, zone, index), service=service, zone=zone
                        )
                    )
        return found

    def _model_instances(self) -> list[Instance]:
        """The model servers: one set of `model_servers.per_zone` (a running mesh may hold
        more, see ResolvedSpec.fleet)."""
        return model_set_instances("", self.zones, self.model_servers)

    def instance(self, name: str) -> Instance:
        for inst in self.instances():
            if inst.name == name:
                return inst
        raise SpecError(f"no instance named {name!r}; known: {[i.name for i in self.instances()]}")


class ResolvedSpec(MeshSpec):
    """A spec whose every listening port is concrete: what a running mesh is.

    `resolve` makes one from a declared MeshSpec; the launcher writes it for the service
    processes, which read it with `load_resolved`. Only here can an address be asked for,
    so a tool that forgets to resolve first fails the type check, not a run.
    """

    # Each zone's mesh listener port (ports.mesh + zone index when fixed).
    mesh_ports: dict[ZoneName, Port]
    # The port of every service instance, by instance name.
    instance_ports: dict[str, Port]
    # The Prometheus /metrics side port of every service instance, by instance name.
    metrics_ports: dict[str, Port]
    # Each zone Envoy's stats listener port, in the per-zone layout (the edge Envoy's is
    # ports.envoy_stats, zone i's envoy_stats + 1 + i unless it is free); empty in the shared
    # layout.
    zone_stats_ports: dict[ZoneName, Port] = Field(default_factory=dict)
    # The port of the Redis the launcher runs itself; None when the spec names its own
    # (feature_store.redis_url is set either way).
    embedded_redis_port: Port | None = None
    # The port of the trace store the launcher runs itself; None when the spec names an
    # OTLP collector of its own, or tracing is off (tracing.otlp_endpoint is set when on).
    embedded_trace_store_port: Port | None = None
    # How the model servers are arranged right now (blue-green and rolling updates change
    # it live; `servemesh up` starts and stops replicas to match). Never in a spec file.
    fleet: FleetState = Field(default_factory=lambda: FleetState())

    @model_validator(mode="after")
    def _fleet_names_what_runs(self) -> ResolvedSpec:
        names = [i.name for i in self.instances()]
        twice = sorted(n for n, count in Counter(names).items() if count > 1)
        if twice:
            raise ValueError(f"fleet.sets: instance names collide: {twice}")
        models = {i.name for i in self.instances() if i.service == "model"}
        scaled = {i.name for i in self.instances() if i.service != "registry"}
        for field_name, listed, known in (
            ("draining", self.fleet.draining, scaled),
            ("standby", self.fleet.standby, scaled),
            ("generations", list(self.fleet.generations), models),
        ):
            unknown = sorted(set(listed) - known)
            if unknown:
                kind = "model server" if known is models else "replica"
                raise ValueError(f"fleet.{field_name}: names no {kind}: {unknown}")
        for index, replica_set in enumerate(self.fleet.sets):
            for model, versions in replica_set.serves.items():
                where = f"fleet.sets[{index}].serves.{model}"
                if model not in self.models:
                    raise ValueError(f"{where}: no such model; models: {sorted(self.models)}")
                unknown = sorted(set(versions) - set(self.models[model].versions))
                if unknown:
                    raise ValueError(f"{where}: no such versions {unknown}")
        return self

    def _model_instances(self) -> list[Instance]:
        found: list[Instance] = []
        for replica_set in self.fleet.sets:
            found += model_set_instances(replica_set.name, self.zones, self.live_model_servers)
        return found

    @property
    def live_model_servers(self) -> Replicas:
        """Model servers per zone as they run: the scaler's counts, else the spec's."""
        if self.fleet.per_zone is None:
            return self.model_servers
        return Replicas.model_construct(per_zone=dict(self.fleet.per_zone))

    def replicas_of(self, kind: ScaledKind) -> Replicas:
        """Replicas per zone of a kind as they run: the scaler's counts, else the spec's."""
        if kind == "model":
            return self.live_model_servers
        counts = self.fleet.pools.get(kind)
        if counts is None:
            return self.declared_replicas(kind)
        return Replicas.model_construct(per_zone=dict(counts))

    def replica_set_of(self, model: str, version: str) -> ReplicaSet:
        """The set whose replicas a version's clusters list: the one that serves it, else
        the first."""
        for replica_set in self.fleet.sets[1:]:
            if version in replica_set.serves.get(model, []):
                return replica_set
        return self.fleet.sets[0]

    def set_replicas(self, set_name: str) -> list[Instance]:
        """The model servers of one set, in start order."""
        return [i for i in self.instances() if i.service == "model" and i.replica_set == set_name]

    def version_replicas(self, model: str, version: str) -> list[Instance]:
        """The model servers a version's clusters list as endpoints."""
        return self.set_replicas(self.replica_set_of(model, version).name)

    @model_validator(mode="after")
    def _every_listener_has_a_port(self) -> ResolvedSpec:
        missing = [i.name for i in self.instances() if not self.instance_ports.get(i.name)]
        if not self.feature_store.redis_url:
            missing.append("feature_store.redis_url")
        missing += [f"mesh listener of {z}" for z in self.zones if not self.mesh_ports.get(z)]
        if self.ports.edge == 0 or self.ports.envoy_admin == 0:
            missing.append("ports.edge or ports.envoy_admin")
        missing += [
            f"metrics of {i.name}" for i in self.instances() if not self.metrics_ports.get(i.name)
        ]
        if self.ports.envoy_stats == 0 or self.ports.prometheus == 0:
            missing.append("ports.envoy_stats or ports.prometheus")
        if missing:
            raise ValueError(f"a resolved spec needs a port for: {', '.join(missing)}")
        return self

    @property
    def redis_url(self) -> str:
        """The online store every feature service reads (always set once resolved)."""
        assert self.feature_store.redis_url, "validated when the spec was resolved"
        return self.feature_store.redis_url

    def redis_password(self) -> str | None:
        """The Redis password from feature_store.password_file (None: no file named). Read
        at each call: clients pass it to redis-py, it never joins the URL."""
        path = self.feature_store.password_file
        if path is None:
            return None
        try:
            return Path(path).read_text().strip() or None
        except FileNotFoundError:
            raise SpecError("feature_store.password_file: no such file") from None

    def port_of(self, instance_name: str) -> int:
        try:
            return self.instance_ports[instance_name]
        except KeyError:
            raise SpecError(f"no instance named {instance_name!r}") from None

    def host_of(self, part: str) -> str:
        """Where an instance (or an Envoy, proxy_part) is reached: discovery.hosts, else
        host."""
        return self.discovery.hosts.get(part, self.host)

    @property
    def listen_host(self) -> str:
        """The address services and Envoy bind: discovery.listen_host, else host."""
        return self.discovery.listen_host or self.host

    def address_of(self, instance_name: str) -> str:
        return f"{self.host_of(instance_name)}:{self.port_of(instance_name)}"

    def metrics_address_of(self, instance_name: str) -> str:
        """host:port of an instance's Prometheus /metrics endpoint."""
        port = self.metrics_ports.get(instance_name)
        if not port:
            raise SpecError(f"no instance named {instance_name!r}: it has no metrics port")
        return f"{self.host_of(instance_name)}:{port}"

    @property
    def envoy_stats_address(self) -> str:
        """host:port of Envoy's stats listener (GET /stats/prometheus); in the per-zone
        layout, the edge Envoy's."""
        return f"{self.host_of(ENVOY_PART)}:{self.ports.envoy_stats}"

    def proxy_stats_port(self, proxy: str) -> int:
        """The stats listener's port of one of the mesh's Envoys."""
        if proxy == EDGE_PROXY:
            return self.ports.envoy_stats
        try:
            return self.zone_stats_ports[proxy]
        except KeyError:
            raise SpecError(f"no Envoy named {proxy!r}; Envoys: {self.proxies()}") from None

    def proxy_stats_address(self, proxy: str) -> str:
        return f"{self.host_of(proxy_part(proxy))}:{self.proxy_stats_port(proxy)}"

    @property
    def prometheus_address(self) -> str:
        """host:port of the mesh's Prometheus (when metrics.prometheus started one)."""
        return f"{self.host}:{self.ports.prometheus}"

    @property
    def mesh_address(self) -> str:
        """Envoy's mesh listener of the first zone (for tools outside any zone)."""
        return self.mesh_address_for(self.zones[0])

    def mesh_address_for(self, zone: str) -> str:
        """Where services of `zone` reach each other: that zone's Envoy mesh listener, whose
        clusters prefer endpoints in the same zone and fail over to the others."""
        try:
            port = self.mesh_ports[zone]
        except KeyError:
            raise SpecError(f"no zone named {zone!r}; zones: {self.zones}") from None
        return f"{self.host_of(proxy_part(self.proxy_of_zone(zone)))}:{port}"

    @property
    def edge_address(self) -> str:
        return f"{self.host_of(ENVOY_PART)}:{self.ports.edge}"

    @property
    def registry_instance(self) -> str:
        return REGISTRY_INSTANCE

    @property
    def registry_address(self) -> str:
        return self.address_of(REGISTRY_INSTANCE)


class Instance(_Strict):
    name: str
    service: ServiceKind
    zone: ZoneName
    # The model-server set it belongs to ("" the first; see FleetState). Other services: "".
    replica_set: str = ""


SetName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9]{0,15}$")]


def replicas_field(kind: ScaledKind) -> str:
    """The spec's field (and the scaling policy's) holding a kind's replicas."""
    return "model_servers" if kind == "model" else kind


def instance_name(kind: ScaledKind, zone: str, index: int) -> str:
    """The name of a kind's `index`-th replica in `zone` (a model server of the first set)."""
    return model_instance_name("", zone, index) if kind == "model" else f"{kind}-{zone}-{index}"


def model_instance_name(set_name: str, zone: str, index: int) -> str:
    """model-<zone>-<i> in the set named "" (the mesh's first), model-<set>-<zone>-<i> in
    any other: the prefix `model-` is what Envoy's certificate check asks of a model server."""
    return f"model-{set_name}-{zone}-{index}" if set_name else f"model-{zone}-{index}"


def model_set_instances(set_name: str, zones: list[str], replicas: Replicas) -> list[Instance]:
    return [
        Instance(
            name=model_instance_name(set_name, zone, index),
            service="model",
            zone=zone,
            replica_set=set_name,
        )
        for zone in zones
        for index in range(replicas.per_zone.get(zone, 0))
    ]


class ReplicaSet(_Strict):
    """A set of model servers, as many per zone as `model_servers.per_zone`. Each loads every
    version the spec lists, like any model server."""

    # "" names the set a mesh starts with; a blue-green update names the other one.
    name: Literal[""] | SetName = ""
    # The versions whose clusters list this set's replicas instead of the first set's, by
    # model (a blue-green update's new version, on its green set).
    serves: dict[Name, list[Name]] = Field(default_factory=dict)


class FleetState(_Strict):
    """How a running mesh's model servers are arranged beyond what a spec file declares:
    what blue-green and rolling updates (servemesh.rollout.fleet) change live, and what the
    launcher follows by starting and stopping replicas."""

    # The first set serves every version no other set serves; a second set exists while a
    # blue-green update runs, until the old set is retired.
    sets: list[ReplicaSet] = Field(default_factory=lambda: [ReplicaSet()], min_length=1)
    # Replicas Envoy is told are draining (EDS health DRAINING): no new calls reach them,
    # calls in flight finish. A rolling update takes one at a time out this way.
    draining: list[str] = Field(default_factory=list)
    # How many times a rolling update asked for a replica to be replaced, by instance; the
    # launcher restarts a replica whose number went up.
    generations: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    # Model servers per zone as the scaler set them (servemesh.scaling); None: the spec's
    # `model_servers.per_zone`. Every set has this many per zone.
    per_zone: dict[ZoneName, Annotated[int, Field(ge=0, le=16)]] | None = None
    # Gateways and feature services per zone as the scaler set them, by kind; a kind not
    # here: the spec's `gateway.per_zone` / `feature.per_zone`.
    pools: dict[FrontKind, dict[ZoneName, Annotated[int, Field(ge=0, le=16)]]] = Field(
        default_factory=dict
    )
    # Replicas started but out of rotation (Envoy is told DRAINING, so no call reaches them):
    # a replica the scaler added, until it is ready (a model server: holds every version),
    # and the pools' warm standbys. Any kind but the registry.
    standby: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _set_names_unique(self) -> FleetState:
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"sets: names must differ, got {names}")
        return self


# The embedded Redis's password, in the state dir (owner-only; created by the launcher).
REDIS_PASSWORD_FILE = "redis-password"
# Each running stream consumer's /metrics address as a Prometheus file-discovery target,
# in the state dir (servemesh/streams/process.py writes one, the mesh's Prometheus reads them).
STREAM_TARGETS_GLOB = "streams/*.targets.json"
# The scaler's /metrics address, likewise (servemesh/scaling/__main__.py writes it).
SCALER_TARGETS_FILE = "scaling/scaler.targets.json"
# What the running mesh started of its model-server fleet, by instance (PID, generation):
# written by the launcher in the state dir, read by blue-green and rolling updates.
FLEET_STATUS_FILE = "fleet-status.json"

# What a resolved spec has and a declared one does not.
RESOLVED_FIELDS = {
    "fleet",
    "mesh_ports",
    "zone_stats_ports",
    "instance_ports",
    "metrics_ports",
    "embedded_redis_port",
    "embedded_trace_store_port",
}


# Where free_port looks first: the ports just below the kernel's ephemeral range.
_LISTEN_SPAN = 20000
# How long a port free_port picked stays claimed: its service binds it within seconds (an
# Envoy, after every service it fronts is ready: well under a minute on a busy machine).
# Short, because a test run resolves thousands of ports.
RESERVATION_S = 120.0
# Expired claims are swept at most this often by each process.
_SWEEP_EVERY_S = 30.0
_last_sweep = [0.0]


def _claims_folder() -> Path:
    folder = Path(tempfile.gettempdir()) / f"servemesh-ports-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _sweep(folder: Path) -> None:
    """Remove the expired claims (left by every caller: none removes its own)."""
    now = time.time()
    if now - _last_sweep[0] < _SWEEP_EVERY_S:
        return
    _last_sweep[0] = now
    for claim in folder.iterdir():
        try:
            if now - claim.stat().st_mtime >= RESERVATION_S:
                claim.unlink(missing_ok=True)
        except OSError:
            continue


_PICKER = random.Random()  # seeded from the OS: two processes never walk the same ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _reserve(port: int) -> bool:
    """Claim `port` for this machine's next RESERVATION_S: false when another caller of
    free_port (any process of this user) holds it. A claim older than that has been bound
    by its service long since, or was never used: it is taken over."""
    folder = _claims_folder()
    _sweep(folder)
    claim = folder / str(port)
    for _ in range(2):
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            try:
                age = time.time() - claim.stat().st_mtime
            except FileNotFoundError:
                continue  # released meanwhile: try again
            if age < RESERVATION_S:
                return False
            claim.unlink(missing_ok=True)
            continue
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        return True
    return False


def free_port(host: str) -> int:
    """A port nobody listens on now, for a service that binds it later.

    Taken below the kernel's ephemeral range when there is room: the kernel hands ports of
    that range to every outgoing connection and every bind to port 0, so a port picked there
    could be taken by one of those before its service binds it (seen with two meshes
    starting side by side). Below it, only another caller of this function could take it:
    each port picked is claimed in a folder of the user's for RESERVATION_S, so two meshes
    resolving at once (two test workers, a benchmark beside the suite) never pick the same
    one in the seconds before their services bind (seen: an Envoy's listener taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    start = max(1024, low - _LISTEN_SPAN)
    for _ in range(256 if low - start >= 1024 else 0):
        port = _PICKER.randrange(start, low)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        if _reserve(port):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def resolve(spec: MeshSpec) -> ResolvedSpec:
    """The spec with every listening port concrete (0 becomes a free port). A spec that is
    already resolved keeps its ports."""
    known = spec if isinstance(spec, ResolvedSpec) else None
    taken: set[int] = set()
    # Every port the running mesh holds: an instance new to it (a replica set a blue-green
    # update adds) must not take one that an instance later in the order keeps.
    held: set[int] = set()
    if known is not None:
        held = {*known.instance_ports.values(), *known.metrics_ports.values()}

    def pick(port: int, *, fresh: bool = False) -> int:
        while port == 0 or port in taken or (fresh and port in held):
            port = free_port(spec.host)
        taken.add(port)
        return port

    mesh_ports = {
        zone: pick(
            known.mesh_ports[zone] if known else (spec.ports.mesh + i if spec.ports.mesh else 0)
        )
        for i, zone in enumerate(spec.zones)
    }
    ports = Ports(
        edge=pick(spec.ports.edge),
        mesh=mesh_ports[spec.zones[0]],
        envoy_admin=pick(spec.ports.envoy_admin),
        services_base=spec.ports.services_base,
        envoy_stats=pick(spec.ports.envoy_stats),
        prometheus=pick(spec.ports.prometheus),
    )
    instance_ports = {}
    for offset, inst in enumerate(spec.instances()):
        wanted = spec.ports.services_base + offset if spec.ports.services_base else 0
        if known is None:
            instance_ports[inst.name] = pick(wanted)
        else:
            kept = known.instance_ports.get(inst.name, 0)
            instance_ports[inst.name] = pick(kept, fresh=not kept)
    # Model servers first, as when they alone had a metrics port; a resolved spec (even one
    # written before the other services had one) keeps the ports it has.
    by_kind = sorted(spec.instances(), key=lambda inst: inst.service != "model")
    metrics_ports = {}
    for inst in by_kind:
        kept = known.metrics_ports.get(inst.name, 0) if known else 0
        metrics_ports[inst.name] = pick(kept, fresh=known is not None and not kept)

    # The zone Envoys' stats listeners (per-zone layout): kept when resolved, else the
    # ports after the edge Envoy's (zone i: envoy_stats + 1 + i), free when that one is.
    def zone_stats_port(index: int, zone: str) -> int:
        if known is not None:
            return known.zone_stats_ports.get(zone, 0)
        return spec.ports.envoy_stats + 1 + index if spec.ports.envoy_stats else 0

    zone_stats_ports = {
        zone: pick(zone_stats_port(i, zone))
        for i, zone in enumerate(spec.zones if spec.proxy.layout == "per_zone" else [])
    }
    # No Redis named: the launcher runs one, on a port chosen now with the others.
    embedded_redis_port = known.embedded_redis_port if known else None
    store = spec.feature_store
    if not store.redis_url:
        embedded_redis_port = pick(0)
        store = store.model_copy(
            update={
                "redis_url": f"redis://{spec.host}:{embedded_redis_port}/0",
                "password_file": str(Path(spec.state_dir) / REDIS_PASSWORD_FILE),
            }
        )
    # No collector named: the launcher runs the embedded trace store, on a port chosen now.
    tracing = spec.tracing
    embedded_trace_store_port = known.embedded_trace_store_port if known else None
    if tracing.enabled and not tracing.otlp_endpoint:
        # The port after the services' (Envoy's rendered config names it), else a free one.
        base = spec.ports.services_base
        embedded_trace_store_port = pick(
            known.embedded_trace_store_port
            if known and known.embedded_trace_store_port
            else (base + len(spec.instances()) if base else 0)
        )
        tracing = tracing.model_copy(
            update={"otlp_endpoint": f"{spec.host}:{embedded_trace_store_port}"}
        )
    fields = spec.model_dump(exclude=RESOLVED_FIELDS)
    return ResolvedSpec.model_validate(
        {
            **fields,
            "feature_store": store.model_dump(),
            "embedded_redis_port": embedded_redis_port,
            "tracing": tracing.model_dump(),
            "embedded_trace_store_port": embedded_trace_store_port,
            # The running arrangement of model servers (a declared spec has none).
            "fleet": known.fleet.model_dump() if known else FleetState().model_dump(),
            "ports": ports.model_dump(),
            "mesh_ports": mesh_ports,
            "zone_stats_ports": zone_stats_ports,
            "instance_ports": instance_ports,
            "metrics_ports": metrics_ports,
        }
    )


def declared(spec: MeshSpec) -> MeshSpec:
    """The declared part of a spec (a resolved spec without its ports), e.g. to compare
    a running mesh's spec with a file."""
    if not isinstance(spec, ResolvedSpec):
        return spec
    fields = spec.model_dump(exclude=RESOLVED_FIELDS)
    if spec.embedded_redis_port is not None:
        fields["feature_store"]["redis_url"] = None  # the launcher's own, not declared
        fields["feature_store"]["password_file"] = None
    if spec.embedded_trace_store_port is not None:
        fields["tracing"]["otlp_endpoint"] = None  # the launcher's own store, not declared
    return MeshSpec.model_validate(fields)


def _line_of(text: str, path: tuple[str | int, ...]) -> int | None:
    """Best-effort line number of a field path in the YAML source, for error messages."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in path:
        if isinstance(node, yaml.MappingNode):
            match = next((v for k, v in node.value if k.value == str(key)), None)
            if match is None:
                return line
            key_node = next(k for k, v in node.value if v is match)
            line, node = key_node.start_mark.line + 1, match
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def parse_spec(text: str, source: str = "<spec>") -> MeshSpec:
    """Parse and validate YAML text; errors name the source, the field and its line."""
    return _parse(MeshSpec, text, source)


# libyaml's loader where PyYAML was built with it (its wheels are): the resolved spec is
# read by every service on each live change and by the scaler every round, and the pure
# Python loader took about 27 ms for it, the C one 6 ms. Both build the same safe types.
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def safe_yaml(text: str) -> object:
    """`yaml.safe_load` on the fastest safe loader there is."""
    return yaml.load(text, Loader=_YAML_LOADER)


def _parse(kind: type[Spec], text: str, source: str) -> Spec:
    try:
        data = safe_yaml(text) or {}
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the spec must be a mapping, got {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = ".".join(str(p) for p in loc) or "(top level)"
            line = _line_of(text, loc)
            where = f"{source}:{line}" if line else source
            problems.append(f"{where}: {field}: {err['msg']}")
        raise SpecError("invalid mesh spec\n  " + "\n  ".join(problems)) from None


def load_spec(path: str | Path | None = None) -> MeshSpec:
    """Load a spec file; with no path, ./mesh.yaml when present, else the built-in defaults."""
    if path is None:
        default = Path("mesh.yaml")
        if not default.is_file():
            return MeshSpec()
        path = default
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_spec(text, str(path))


def parse_resolved(text: str, source: str = "<resolved spec>") -> ResolvedSpec:
    """Parse a resolved spec (every port concrete); errors as parse_spec's."""
    return _parse(ResolvedSpec, text, source)


def parse_spec_or_resolved(text: str, source: str = "<spec>") -> MeshSpec:
    """A declared spec, or a resolved one when the text names resolved ports."""
    try:
        data = safe_yaml(text)
    except yaml.YAMLError:
        data = None  # parse_spec says what is wrong with it
    if isinstance(data, dict) and RESOLVED_FIELDS & set(data):
        return parse_resolved(text, source)
    return parse_spec(text, source)


def load_resolved(path: str | Path) -> ResolvedSpec:
    """Load the resolved spec a launcher wrote (what every service process reads)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror}") from None
    return _parse(ResolvedSpec, text, str(path))


def dump_spec(spec: MeshSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
