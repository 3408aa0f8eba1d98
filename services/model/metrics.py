"""Prometheus metrics of a model server, read from each batcher's counters at scrape time.

Nothing is recorded on the serving path beyond the batcher's own counters (BatcherStats): a
collector turns them into metric families whenever /metrics is scraped. Each server has its
own CollectorRegistry, so several servers can live in one process (the tests do that).

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

Outcomes: ok, shed (queue full), refused (deadline cannot be met), expired (deadline passed
in the queue), late (passed during inference), cancelled, failed, closed. The mean batch
size is inferences_total / executions_total (Triton's count / exec_count), or
batch_size_sum / batch_size_count.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
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
        for model, version, batcher in self.source():
            labels = [model, version]
            stats = batcher.stats
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
        )


def model_registry(source: Source) -> CollectorRegistry:
    """A registry of its own (not the process-global one) holding the batchers' metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BatcherCollector(source))
    return registry


class MetricsEndpoint:
    """/metrics over HTTP on a side port, served from a thread; `close` stops it."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def close(self) -> None:
        # shutdown() waits out the server's poll interval: not on the event loop.
        await asyncio.to_thread(self._server.shutdown)
        self._server.server_close()
        self._thread.join(timeout=5)
