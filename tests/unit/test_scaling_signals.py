"""A pool's signals from its replicas' real /metrics text (the runtime's RPC collector and
the model server's queue gauge, rendered by prometheus_client), scraped twice: the
interval's calls, p99, CPU, errors, and the queue as it stands."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from servemesh.observe.scrape import Sample, parse
from servemesh.scaling.signals import INFER, PoolReader
from servemesh.services.runtime.metrics import MethodMetrics, RpcCollector


class Replica:
    """One model server's metrics, as its /metrics would render them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.infer = MethodMetrics()
        self.registry.register(RpcCollector("model", {INFER: self.infer}))
        self.queue = Gauge("servemesh_model_queue_depth", "q", registry=self.registry)
        self.cpu = Counter("process_cpu_seconds", "cpu", registry=self.registry)

    def calls(self, count: int, seconds: float, code: str = "OK") -> None:
        for _ in range(count):
            self.infer.end(time.perf_counter() - seconds, code)

    def text(self) -> list[Sample]:
        return parse(generate_latest(self.registry).decode())


def test_the_interval_between_two_scrapes_gives_the_pools_signals() -> None:
    replicas = {"a": Replica(), "b": Replica()}
    now = [100.0]
    reader = PoolReader(lambda address: replicas[address].text(), clock=lambda: now[0])
    first = reader.read({"model-zone-a-0": "a", "model-zone-a-1": "b"})
    assert first.replicas == 2 and first.p99_ms is None and first.cpu is None  # no interval yet

    replicas["a"].calls(95, 0.004)
    replicas["a"].calls(5, 0.4, code="UNAVAILABLE")
    replicas["b"].calls(100, 0.004)
    replicas["a"].queue.set(6)
    replicas["b"].queue.set(2)
    replicas["a"].cpu.inc(1.5)
    replicas["b"].cpu.inc(0.5)
    now[0] = 102.0
    found = reader.read({"model-zone-a-0": "a", "model-zone-a-1": "b"})
    assert found.calls_per_s == pytest.approx(100.0)  # 200 calls in 2 s
    assert found.error_ratio == pytest.approx(0.025)
    assert found.queue_depth == pytest.approx(4.0)
    assert found.cpu == pytest.approx(0.5)  # 2 CPU-s over 2 s on 2 replicas
    # 5 of 200 calls took 400 ms: the 99th percentile lies in their bucket.
    assert found.p99_ms is not None and 250 < found.p99_ms <= 500


def test_a_replica_that_does_not_answer_is_left_out_and_a_gone_one_forgotten() -> None:
    replica = Replica()

    def scrape(address: str) -> list[Sample]:
        if address == "down":
            raise ConnectionRefusedError("no /metrics")
        return replica.text()

    now = [0.0]
    reader = PoolReader(scrape, clock=lambda: now[0])
    reader.read({"x": "up", "y": "down"})
    replica.calls(10, 0.01)
    now[0] = 1.0
    found = reader.read({"x": "up"})
    assert found.replicas == 1 and found.calls_per_s == pytest.approx(10.0)
