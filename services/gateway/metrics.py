"""The gateway's own Prometheus metrics: predictions per model, version and degraded flag,
by status, and their latency, beside the RPC metrics every service has.

| metric | type | labels |
| --- | --- | --- |
| servemesh_gateway_predictions_total | counter | model, version, degraded, code, route |
| servemesh_gateway_predict_duration_seconds | histogram | model, version, route |
| servemesh_gateway_prediction_score | histogram | model, version, route |
| servemesh_gateway_model_calls_total | counter | model, version, code, route |
| servemesh_gateway_coalesced_members | histogram | call |
| servemesh_gateway_coalesce_waiting | gauge | call |
| servemesh_gateway_tier_lookups_total | counter | model, tier, result |
| servemesh_gateway_oip_infers_total | counter | model, version, code, route, method |
| servemesh_gateway_oip_infer_duration_seconds | histogram | model, version, route, method |

`version` is the version that answered (the replica says which); a call whose model call
failed carries the version Envoy routed it to (Envoy names it in a response header), one
that failed before that the version it pinned, else "". `model` is "" for a call naming no
model of the spec, so a caller cannot grow the label set. A degraded fallback answer is
version "fallback".

`route` says how the call chose its version: "routed" (the traffic split and its sticky
buckets picked it) or "pinned" (the caller named `version`). A rollout's analysis judges
routed calls only: a caller who pins a canary chooses its rows and deadlines, and would
otherwise steer the verdict. Pinned calls are counted (and reported) apart.

The last two are what a rollout's analysis compares between a canary and its baseline
(servemesh/rollout/analysis.py):

- `prediction_score`: every score the gateway answers (one per row; a model answering in
  named outputs has none), by answering version, in the fixed buckets of
  wire.SCORE_BUCKETS. A fallback's score is not the model's and is left out; a NaN score
  is counted in the +Inf bucket, so a version answering NaN moves mass there.
- `model_calls_total`: every ModelInfer the gateway made, by the version Envoy routed it
  to and its status, including calls a fallback then answered for: the version's own
  success ratio, which a fallback would otherwise hide from `predictions_total`.

`coalesced_members`: the Predicts that shared each downstream call the gateway made while
coalescing (services/gateway/coalesce.py), by call ("features": a GetFeatures, "model": a
ModelInfer); a call made for one Predict alone counts 1. `coalesce_waiting`: the Predicts
queued at this moment to join the next such call (read at each scrape): a queue that stays
long says the calls in flight are slower than the Predicts arriving.

`oip_infers_total` and `oip_infer_duration_seconds`: the OIP ModelInfer calls callers make
at the edge (services/gateway/oip.py), which no Predict counts: by the version that
answered (or the one Envoy routed a failed call to, else the pinned one), status and route;
`method` is "ModelInfer". The SLO rules (servemesh/slo_rules.py) count them beside Predict:
a model's error budget is spent by every caller's calls, whichever protocol they speak.
The `method` label also keeps their series apart from Predict's where a rule drops the
metric name.

`tier_lookups_total`: each lookup of a model's precomputed and cache tiers
(services/gateway/tiers.py) by result: "hit" (it answered), "miss", "stale" (an answer
there, refused for its age) or "skipped" (the lookup could not be made: the feature store
unreachable; the call went online). The answer's tier is in the prediction log.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from servemesh.contract.wire import ROUTE_PINNED, ROUTE_ROUTED, SCORE_BUCKETS
from servemesh.services.runtime.errors import MeshError
from servemesh.services.runtime.metrics import RPC_BUCKETS
from servemesh.spec import MeshSpec
from servemesh_api.gateway.v1 import gateway_pb2

Key = tuple[str, str, str, str, str]


# Members per coalesced call: up to the largest row cap a spec allows.
COALESCED_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)

# The `method` label of the OIP call metrics.
OIP_INFER_METHOD = "ModelInfer"

# The version a degraded fallback answer names (services/gateway/predict.py answers it).
FALLBACK_VERSION = "fallback"


class PredictMetrics:
    """Counters and latency of Predict, with label children bound once per combination."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._predictions = Counter(
            "servemesh_gateway_predictions",
            "Predict calls by model, answering version, degraded flag and status code.",
            ["model", "version", "degraded", "code", "route"],
            registry=self.registry,
        )
        self._duration = Histogram(
            "servemesh_gateway_predict_duration_seconds",
            "Seconds the gateway took to answer Predict, by model and answering version.",
            ["model", "version", "route"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self._score = Histogram(
            "servemesh_gateway_prediction_score",
            "Scores the gateway answered, one per row, by model and answering version.",
            ["model", "version", "route"],
            buckets=SCORE_BUCKETS,
            registry=self.registry,
        )
        self._model_calls = Counter(
            "servemesh_gateway_model_calls",
            "ModelInfer calls by model, the version Envoy routed them to, and status code.",
            ["model", "version", "code", "route"],
            registry=self.registry,
        )
        self._coalesced = Histogram(
            "servemesh_gateway_coalesced_members",
            "Predicts that shared one downstream call, by call (features, model).",
            ["call"],
            buckets=COALESCED_BUCKETS,
            registry=self.registry,
        )
        self._waiting = Gauge(
            "servemesh_gateway_coalesce_waiting",
            "Predicts queued to share the next downstream call, by call (features, model).",
            ["call"],
            registry=self.registry,
        )
        self._tiers = Counter(
            "servemesh_gateway_tier_lookups",
            "Lookups of a model's precomputed and cache tiers by result.",
            ["model", "tier", "result"],
            registry=self.registry,
        )
        self.feed_changes = Counter(
            "servemesh_gateway_feed_changes",
            "Changes the feature store's feed told this gateway of (caches with freshness: feed).",
            registry=self.registry,
        )
        self.feed_live = Gauge(
            "servemesh_gateway_feed_live",
            "1 while this gateway follows the feature store's change feed, else 0.",
            registry=self.registry,
        )
        self.feed_breaks = Counter(
            "servemesh_gateway_feed_breaks",
            "Times the change feed was lost (each empties the caches that follow it).",
            registry=self.registry,
        )
        self._oip_infers = Counter(
            "servemesh_gateway_oip_infers",
            "OIP ModelInfer calls at the edge by model, answering version and status code.",
            ["model", "version", "code", "route", "method"],
            registry=self.registry,
        )
        self._oip_duration = Histogram(
            "servemesh_gateway_oip_infer_duration_seconds",
            "Seconds the gateway took to answer an OIP ModelInfer, by model and version.",
            ["model", "version", "route", "method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self._tier_children: dict[tuple[str, str, str], Any] = {}
        self._coalesced_by: dict[tuple[str], Any] = {}
        self._counters: dict[Key, Any] = {}
        self._timers: dict[tuple[str, str, str], Any] = {}
        self._scores: dict[tuple[str, str, str], Any] = {}
        self._calls: dict[tuple[str, str, str, str], Any] = {}
        self._oip_counters: dict[tuple[str, ...], Any] = {}
        self._oip_timers: dict[tuple[str, ...], Any] = {}

    def record_tier(self, model: str, tier: str, result: str) -> None:
        _bound(self._tier_children, self._tiers, (model, tier, result)).inc()

    def record(
        self,
        model: str,
        version: str,
        degraded: bool,
        code: str,
        seconds: float,
        route: str = ROUTE_ROUTED,
    ) -> None:
        key = (model, version, "true" if degraded else "false", code, route)
        _bound(self._counters, self._predictions, key).inc()
        _bound(self._timers, self._duration, (model, version, route)).observe(seconds)

    def record_oip_infer(
        self, model: str, version: str, code: str, seconds: float, route: str = ROUTE_ROUTED
    ) -> None:
        """One OIP ModelInfer answered at the edge (how it ended, and in how long)."""
        key = (model, version, code, route, OIP_INFER_METHOD)
        _bound(self._oip_counters, self._oip_infers, key).inc()
        timer_key = (model, version, route, OIP_INFER_METHOD)
        _bound(self._oip_timers, self._oip_duration, timer_key).observe(seconds)

    def record_scores(
        self, model: str, version: str, scores: Sequence[float], route: str = ROUTE_ROUTED
    ) -> None:
        """The scores of one answer (one per row) under the version that answered."""
        if not scores:
            return
        child = _bound(self._scores, self._score, (model, version, route))
        for score in scores:
            # NaN is below no bound, so prometheus_client would count it in no bucket.
            child.observe(score if score == score else math.inf)

    def record_model_call(
        self, model: str, version: str, code: str, route: str = ROUTE_ROUTED
    ) -> None:
        """One ModelInfer call, by the version Envoy routed it to, how it ended, and whether
        the caller pinned the version (route "pinned") or the split chose it ("routed")."""
        _bound(self._calls, self._model_calls, (model, version, code, route)).inc()

    def watch_waiting(self, call: str, waiting: Callable[[], int]) -> None:
        """Report `waiting()` as the Predicts queued for `call`, read at each scrape (so the
        hot path pays nothing for it)."""
        self._waiting.labels(call).set_function(waiting)

    def record_coalesced(self, call: str, members: int) -> None:
        """One downstream call made for `members` Predicts."""
        _bound(self._coalesced_by, self._coalesced, (call,)).observe(members)


def _bound(children: dict[Any, Any], family: Any, key: tuple[str, ...]) -> Any:
    """`family`'s child for the label values `key`, bound once and kept in `children`:
    `labels()` takes the family's lock and builds a key on every call, which the request
    path need not pay."""
    child = children.get(key)
    if child is None:
        child = children[key] = family.labels(*key)
    return child


class _Observed(Protocol):
    spec: MeshSpec
    metrics: PredictMetrics


S = TypeVar("S", bound=_Observed)
Predict = Callable[
    [S, gateway_pb2.PredictRequest, grpc.aio.ServicerContext],
    Awaitable[gateway_pb2.PredictResponse],
]


def _failure_code(exc: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(exc, MeshError):
        return exc.code.name
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if isinstance(exc, Exception):
        return "INTERNAL"  # what ErrorStatusInterceptor answers for it
    return "CANCELLED"


def route_of(request: gateway_pb2.PredictRequest) -> str:
    """How a Predict chose its version: pinned by the caller, or routed by the split."""
    return ROUTE_PINNED if request.version else ROUTE_ROUTED


def observed(predict: Predict[S]) -> Predict[S]:
    """Record every Predict in the servicer's `metrics`: answers by the version that
    answered, failures by the status the caller gets."""

    @functools.wraps(predict)
    async def call(
        self: S, request: gateway_pb2.PredictRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.PredictResponse:
        started = time.perf_counter()
        route = route_of(request)
        try:
            answer = await predict(self, request, context)
        except BaseException as exc:
            seconds = time.perf_counter() - started
            known = self.spec.models.get(request.model)
            model = request.model if known is not None else ""
            # The version Envoy routed the failed model call to, when it got that far.
            version = getattr(exc, "routed_version", "") if known else ""
            if not version:
                version = request.version if known and request.version in known.versions else ""
            code = _failure_code(exc, context)
            self.metrics.record(model, version, False, code, seconds, route)
            raise
        seconds = time.perf_counter() - started
        self.metrics.record(
            request.model, answer.model_version, answer.degraded, "OK", seconds, route
        )
        if answer.model_version != FALLBACK_VERSION:
            self.metrics.record_scores(request.model, answer.model_version, answer.scores, route)
        return answer

    return call
