"""Prometheus metrics of a model server, read from each batcher's counters at scrape time.

Nothing is recorded on the serving path beyond the batcher's own counters (BatcherStats): a
collector turns them into metric families whenever /metrics is scraped. The collector joins
the server's own registry (services/runtime/metrics.py), so one endpoint serves these, the
RPC metrics and the process's, and several servers can live in one process (the tests).

Every metric is labelled model and version (requests_total also outcome):

| metric | type | what |
| --- | --- | --- |
| servemesh_model_queue_depth | gauge | requests waiting |
| servemesh_model_requests_total | counter | requests by outcome |
| servemesh_model_inferences_total | counter | rows answered |
| servemesh_model_executions_total | counter | model calls |
| servemesh_model_batch_size | histogram | rows per model call |
| servemesh_model_queue_wait_seconds | histogram | queue wait of each computed request |
| servemesh_model_compute_seconds | histogram | seconds per successful model call |
| servemesh_model_expired_computed_total | counter | requests computed after their deadline |
| servemesh_model_on_gpu | gauge | 1 when the version runs on a GPU (the cost of GPU-hours) |

The readiness checks (`checks`, `readiness`) have metrics of their own, read at scrape time
from the server's last results: per version (model, version) the last check's verdict, when
it finished and how long it took; and the replica's readiness and liveness as its health
service answers them.

| metric | type | what |
| --- | --- | --- |
| servemesh_model_check_ok | gauge | 1 when the version's last readiness check passed, else 0 |
| servemesh_model_check_timestamp_seconds | gauge | Unix time the last check finished |
| servemesh_model_check_duration_seconds | gauge | seconds the last check took (or waited) |
| servemesh_model_server_ready | gauge | 1 while the replica reports ready (SERVING) |
| servemesh_model_server_live | gauge | 1 while the replica reports alive |

An on-demand pool's server (docs/models.md, "Many models in one pool") adds, unlabelled:
servemesh_model_on_demand_calls_total{result=hit|miss}, ..._on_demand_loads_total{outcome},
..._on_demand_load_seconds_total, servemesh_model_evictions_total,
servemesh_model_memory_used_bytes and servemesh_model_memory_budget_bytes.

Outcomes: ok, shed (queue full), refused (deadline cannot be met), expired (deadline passed
in the queue), late (passed during inference), cancelled, failed, closed. The mean batch
size is inferences_total / executions_total (Triton's count / exec_count), or
batch_size_sum / batch_size_count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from servemesh.services.model.batching import Batcher, Buckets
from servemesh.services.model.checks import CheckResult, ModelChecks
from servemesh.services.model.on_demand import OnDemand, OnDemandStats

log = logging.getLogger(__name__)

OUTCOMES = ("ok", "shed", "refused", "expired", "late", "cancelled", "failed", "closed")
LABELS = ["model", "version"]

# (model, version, batcher) for every version the server currently serves.
Source = Callable[[], Iterable[tuple[str, str, Batcher]]]


def _add_histogram(family: HistogramMetricFamily, labels: list[str], hist: Buckets) -> None:
    cumulative: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
        running += count
        cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    family.add_metric(labels, cumulative, sum_value=hist.sum)


class BatcherCollector(Collector):
    """Metric families for every batcher `source` yields, built at scrape time."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "servemesh_model_queue_depth", "Requests waiting in the batch queue.", labels=LABELS
        )
        outcomes = CounterMetricFamily(
            "servemesh_model_requests",
            "Requests by outcome (ok, shed, refused, expired, late, cancelled, failed, closed).",
            labels=[*LABELS, "outcome"],
        )
        inferences = CounterMetricFamily(
            "servemesh_model_inferences", "Rows answered (Triton's inference count).", labels=LABELS
        )
        executions = CounterMetricFamily(
            "servemesh_model_executions",
            "Model calls (Triton's execution count); mean batch = inferences / executions.",
            labels=LABELS,
        )
        expired_computed = CounterMetricFamily(
            "servemesh_model_expired_computed",
            "Requests that reached the model after their deadline (0 unless deadlines are "
            "ignored).",
            labels=LABELS,
        )
        batch_size = HistogramMetricFamily(
            "servemesh_model_batch_size", "Rows per model call.", labels=LABELS
        )
        queue_wait = HistogramMetricFamily(
            "servemesh_model_queue_wait_seconds",
            "Seconds each computed request waited in the queue.",
            labels=LABELS,
        )
        compute = HistogramMetricFamily(
            "servemesh_model_compute_seconds",
            "Seconds per successful model call (forward pass in the worker thread).",
            labels=LABELS,
        )
        on_gpu = GaugeMetricFamily(
            "servemesh_model_on_gpu",
            "1 when the version runs on a GPU, else 0.",
            labels=LABELS,
        )
        for model, version, batcher in self.source():
            labels = [model, version]
            stats = batcher.stats
            device = getattr(batcher.runner, "device", None)
            on_gpu.add_metric(labels, 1.0 if getattr(device, "type", "cpu") == "cuda" else 0.0)
            depth.add_metric(labels, batcher.waiting)
            for outcome in OUTCOMES:
                outcomes.add_metric([*labels, outcome], stats.outcomes.get(outcome, 0))
            inferences.add_metric(labels, stats.inference_count)
            executions.add_metric(labels, stats.executions)
            expired_computed.add_metric(labels, stats.expired_computed)
            _add_histogram(batch_size, labels, stats.batch_size_hist)
            _add_histogram(queue_wait, labels, stats.queue_wait_hist)
            _add_histogram(compute, labels, stats.compute_hist)
        yield from (
            depth,
            outcomes,
            inferences,
            executions,
            expired_computed,
            batch_size,
            queue_wait,
            compute,
            on_gpu,
        )


def add_batcher_metrics(registry: CollectorRegistry, source: Source) -> None:
    """Serve the batchers' metrics from `registry` (the server's own, beside its RPC
    metrics: one /metrics endpoint per process)."""
    registry.register(BatcherCollector(source))


class CheckSource(Protocol):
    """What the check metrics read: the model server (`readiness.ModelServer`)."""

    checks: ModelChecks

    def is_ready(self) -> bool: ...

    def is_alive(self) -> bool: ...


class CheckCollector(Collector):
    """The last readiness check of every version, and the replica's readiness and liveness."""

    def __init__(self, source: CheckSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        ok = GaugeMetricFamily(
            "servemesh_model_check_ok",
            "1 when the version's last readiness check (sample rows through its worker "
            "thread, outputs of the declared shape and finite) passed, else 0.",
            labels=LABELS,
        )
        at = GaugeMetricFamily(
            "servemesh_model_check_timestamp_seconds",
            "Unix time the version's last readiness check finished or was judged hung.",
            labels=LABELS,
        )
        took = GaugeMetricFamily(
            "servemesh_model_check_duration_seconds",
            "Seconds the version's last readiness check took (or waited, when hung).",
            labels=LABELS,
        )
        results: Mapping[tuple[str, str], CheckResult] = dict(self.source.checks.results)
        for (model, version), result in sorted(results.items()):
            labels = [model, version]
            ok.add_metric(labels, 1.0 if result.ok else 0.0)
            at.add_metric(labels, result.at)
            took.add_metric(labels, result.seconds)
        ready = GaugeMetricFamily(
            "servemesh_model_server_ready",
            "1 while the replica reports ready (every routed version loaded and passing).",
        )
        ready.add_metric([], 1.0 if self.source.is_ready() else 0.0)
        live = GaugeMetricFamily(
            "servemesh_model_server_live",
            "1 while the replica reports alive (its event loop and model threads answer).",
        )
        live.add_metric([], 1.0 if self.source.is_alive() else 0.0)
        yield from (ok, at, took, ready, live)


def add_check_metrics(registry: CollectorRegistry, source: CheckSource) -> None:
    """Serve the readiness checks' metrics from `registry` (the server's own)."""
    registry.register(CheckCollector(source))


class OnDemandSource(Protocol):
    """What the on-demand metrics read: an on-demand repository (`repository`)."""

    stats: OnDemandStats
    on_demand: OnDemand | None

    def used_bytes(self) -> int: ...


class OnDemandCollector(Collector):
    """An on-demand pool's server: calls that found their version loaded or waited for
    it, loads, evictions, and the bytes held against the budget."""

    def __init__(self, source: OnDemandSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        stats = self.source.stats
        calls = CounterMetricFamily(
            "servemesh_model_on_demand_calls",
            "Calls of an on-demand pool's server by whether their version was loaded (hit) "
            "or they waited for its load (miss).",
            labels=["result"],
        )
        calls.add_metric(["hit"], stats.hits)
        calls.add_metric(["miss"], stats.misses)
        loads = CounterMetricFamily(
            "servemesh_model_on_demand_loads",
            "On-demand loads by outcome.",
            labels=["outcome"],
        )
        loads.add_metric(["ok"], stats.loads)
        loads.add_metric(["failed"], stats.load_failures)
        load_seconds = CounterMetricFamily(
            "servemesh_model_on_demand_load_seconds",
            "Seconds spent in on-demand loads that finished (divide by the ok loads).",
        )
        load_seconds.add_metric([], stats.load_seconds_sum)
        evictions = CounterMetricFamily(
            "servemesh_model_evictions",
            "Versions evicted (least recently used, idle) to keep the memory budget.",
        )
        evictions.add_metric([], stats.evictions)
        used = GaugeMetricFamily(
            "servemesh_model_memory_used_bytes",
            "Bytes of the weights of every version loaded (what the budget counts).",
        )
        used.add_metric([], self.source.used_bytes())
        yield from (calls, loads, load_seconds, evictions, used)
        on_demand = self.source.on_demand
        if on_demand is not None and on_demand.budget_bytes is not None:
            budget = GaugeMetricFamily(
                "servemesh_model_memory_budget_bytes", "The pool's memory budget per server."
            )
            budget.add_metric([], on_demand.budget_bytes)
            yield budget


def add_on_demand_metrics(registry: CollectorRegistry, source: OnDemandSource) -> None:
    """Serve an on-demand repository's metrics from `registry` (the server's own)."""
    registry.register(OnDemandCollector(source))
