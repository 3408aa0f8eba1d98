"""The gateway's own Prometheus metrics: predictions per model, version and degraded flag,
by status, and their latency, beside the RPC metrics every service has.

| metric | type | labels |
| --- | --- | --- |
| servemesh_gateway_predictions_total | counter | model, version, degraded, code |
| servemesh_gateway_predict_duration_seconds | histogram | model, version |

`version` is the version that answered (the replica says which); a call that failed before
one did carries the version it pinned, else "". `model` is "" for a call naming no model of
the spec, so a caller cannot grow the label set.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from servemesh.services.runtime.errors import MeshError
from servemesh.services.runtime.metrics import RPC_BUCKETS
from servemesh.spec import MeshSpec
from servemesh_api.gateway.v1 import gateway_pb2

Key = tuple[str, str, str, str]


class PredictMetrics:
    """Counters and latency of Predict, with label children bound once per combination."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._predictions = Counter(
            "servemesh_gateway_predictions",
            "Predict calls by model, answering version, degraded flag and status code.",
            ["model", "version", "degraded", "code"],
            registry=self.registry,
        )
        self._duration = Histogram(
            "servemesh_gateway_predict_duration_seconds",
            "Seconds the gateway took to answer Predict, by model and answering version.",
            ["model", "version"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self._counters: dict[Key, Any] = {}
        self._timers: dict[tuple[str, str], Any] = {}

    def record(self, model: str, version: str, degraded: bool, code: str, seconds: float) -> None:
        key = (model, version, "true" if degraded else "false", code)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self._predictions.labels(*key)
        counter.inc()
        timer = self._timers.get((model, version))
        if timer is None:
            timer = self._timers[(model, version)] = self._duration.labels(model, version)
        timer.observe(seconds)


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


def observed(predict: Predict[S]) -> Predict[S]:
    """Record every Predict in the servicer's `metrics`: answers by the version that
    answered, failures by the status the caller gets."""

    @functools.wraps(predict)
    async def call(
        self: S, request: gateway_pb2.PredictRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.PredictResponse:
        started = time.perf_counter()
        try:
            answer = await predict(self, request, context)
        except BaseException as exc:
            seconds = time.perf_counter() - started
            known = self.spec.models.get(request.model)
            model = request.model if known is not None else ""
            version = request.version if known and request.version in known.versions else ""
            self.metrics.record(model, version, False, _failure_code(exc, context), seconds)
            raise
        seconds = time.perf_counter() - started
        self.metrics.record(request.model, answer.model_version, answer.degraded, "OK", seconds)
        return answer

    return call
