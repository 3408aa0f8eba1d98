"""The spec's models (`models:`) and the pools of model servers they are placed on
(`pools:`): versions, inputs, batching, the tiers in front of the online path, the
gateway's coalescing, and how pools are named."""

from __future__ import annotations

import re
from collections import Counter
from typing import Annotated, Literal

from pydantic import (
    ByteSize,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from servemesh.contract.demo import DEMO_FEATURES, DEMO_SOURCE_PREFIX
from servemesh.spec.base import Name, ScaledKind, ZoneName, _Strict
from servemesh.spec.durations import Duration, duration_seconds
from servemesh.spec.features import FeatureName
from servemesh.spec.policy import RoutePolicy, ShadowSpec


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


# A model-server pool's name: part of its processes' names (model-<pool>-<zone>-<i>) and of
# their certificates' DNS names, so short, lower case, no separators.
POOL_NAME_PATTERN = r"^[a-z][a-z0-9]{0,15}$"
PoolName = Annotated[str, Field(pattern=POOL_NAME_PATTERN)]
# The pool of a mesh with no model at all (its model servers are model-<zone>-<i>, loading
# nothing). Every model is on a pool with a name: its own, unless it names one.
SHARED_POOL = ""


def own_pool_name(model: str) -> str:
    """The pool a model that names none is placed on: its own, named after it (the model's
    name less what a pool name cannot hold, at most 16 characters: `fraud` -> `fraud`,
    `churn_v2-eu` -> `churnv2eu`)."""
    name = re.sub(r"[^a-z0-9]", "", model)[:16]
    return name if re.match(POOL_NAME_PATTERN, name) else f"m{name}"[:16]


class PoolSpec(_Strict):
    """A pool of model servers of its own: processes that load only the pool's models, run
    under a user of their own (when the mesh runs as root) and fail alone. A model is placed
    on one with `pool:`; this entry only changes a pool's settings."""

    # Model servers per zone; None: as many as the shared model servers
    # (`model_servers.per_zone`, or the scaler's count for them).
    per_zone: dict[ZoneName, Annotated[int, Field(ge=0, le=16)]] | None = None
    # Bytes of model memory each server of the pool may hold ("512MiB", "2GiB" or an int of
    # bytes): a server holds many versions and loads each on its first call, evicting the
    # least recently used idle version when a load would pass the budget (docs/models.md,
    # "Many models in one pool"). What a version costs is its weights: parameter and buffer
    # bytes, measured at its load. None: no budget.
    memory_budget: ByteSize | None = Field(default=None, ge=1 << 20)
    # When a server loads the pool's versions: "eager", every version before it turns
    # ready (the shared servers' way); "on_demand", each on its first call. Unset: on demand
    # when a budget is set (a budget is only kept by loading and evicting), else eager.
    load: Literal["eager", "on_demand"] | None = None

    @model_validator(mode="after")
    def _budget_needs_on_demand(self) -> PoolSpec:
        # Eager loading holds every version at once: a budget it passed could only be kept
        # by refusing to start, so the two together are refused here, before any server.
        if self.memory_budget is not None and self.load == "eager":
            raise ValueError(
                "memory_budget: needs load: on_demand (an eager pool holds every version at "
                "once); drop `load: eager` or the budget"
            )
        return self

    @property
    def on_demand(self) -> bool:
        """Whether the pool's servers load each version on its first call."""
        if self.load is not None:
            return self.load == "on_demand"
        return self.memory_budget is not None


class ModelSpec(_Strict):
    # The pool of model servers that serves this model (docs/architecture.md, "Pools"):
    # processes that load only the pool's models, which a crash or a hostile version of
    # another model cannot reach. None: a pool of its own, named after the model
    # (`own_pool_name`); name one to place several models on the same processes on purpose.
    pool: PoolName | None = None
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
    # Keep each call's feature values in the prediction log (its `features` column, at most
    # prediction_log.max_feature_bytes of JSON), which drift (`servemesh drift`) reads. Off:
    # callers' rows are theirs; the log keeps only the values' hash and count.
    log_features: bool = False

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


def scaled_pool_label(kind: ScaledKind, pool: str = SHARED_POOL) -> str:
    """How the scaler names what it scales, in its status, history and metrics: a model
    pool as its processes' prefix (`model-fraud`), the gateways and feature services by
    kind."""
    return f"model-{pool}" if kind == "model" and pool else kind
