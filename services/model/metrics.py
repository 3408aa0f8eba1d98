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

Outcomes: ok, shed (queue full), refused (deadline cannot be met), expired (deadline passed
in the queue), late (passed during inference), cancelled, failed, closed. The mean batch
size is inferences_total / executions_total (Triton's count / exec_count), or
batch_size_sum / batch_size_count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from servemesh.services.model.batching import Batcher, Buckets

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
