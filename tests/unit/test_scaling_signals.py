"""A pool's signals from its replicas' real /metrics text (the runtime's RPC collector and
the model server's queue gauge, rendered by prometheus_client), scraped twice: the
interval's calls, p99, CPU, errors, and the queue as it stands."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from servemesh.observe.scrape import Sample, parse
from servemesh.scaling.signals import INFER, SERVING_METHODS, PoolReader
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
    first = reader.read({"model-fraud-zone-a-0": "a", "model-fraud-zone-a-1": "b"})
    assert first.replicas == 2 and first.p99_ms is None and first.cpu is None  # no interval yet

    replicas["a"].calls(95, 0.004)
    replicas["a"].calls(5, 0.4, code="UNAVAILABLE")
    replicas["b"].calls(100, 0.004)
    replicas["a"].queue.set(6)
    replicas["b"].queue.set(2)
    replicas["a"].cpu.inc(1.5)
    replicas["b"].cpu.inc(0.5)
    now[0] = 102.0
    found = reader.read({"model-fraud-zone-a-0": "a", "model-fraud-zone-a-1": "b"})
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


PREDICT = SERVING_METHODS["gateway"]


def test_a_gateway_pool_reads_its_predict_calls_and_in_flight_not_other_methods() -> None:
    """A gateway's load is its Predict calls: their rate, p99 and the calls in flight when
    scraped; a Health call beside them counts for nothing, and it has no batch queue."""
    registry = CollectorRegistry()
    predict, health = MethodMetrics(), MethodMetrics()
    registry.register(
        RpcCollector("gateway", {PREDICT: predict, "/grpc.health.v1.Health/Check": health})
    )
    now = [0.0]
    reader = PoolReader(
        lambda address: parse(generate_latest(registry).decode()),
        clock=lambda: now[0],
        method=PREDICT,
    )
    reader.read({"gateway-zone-a-0": "g"})
    for _ in range(40):
        predict.end(predict.begin() - 0.002, "OK")
    for _ in range(500):
        health.end(health.begin() - 3.0, "OK")
    open_calls = [predict.begin() for _ in range(12)]
    health.begin()
    now[0] = 2.0
    found = reader.read({"gateway-zone-a-0": "g"})
    assert found.calls_per_s == pytest.approx(20.0)  # 40 Predicts in 2 s, not the 500 Checks
    assert found.p99_ms is not None and found.p99_ms <= 5.0  # the Checks' 3 s left out
    assert found.in_flight == pytest.approx(12.0)
    assert found.queue_depth is None
    for started in open_calls:
        predict.end(started, "OK")


def test_each_pool_and_zone_keeps_its_own_interval() -> None:
    """Two zones read in turn each get their interval's calls: a reader forgets what a read
    does not name, so the scaler keeps one per pool and zone (one shared reader saw no
    interval in any zone of a two-zone mesh)."""
    replicas = {"a": Replica(), "b": Replica()}
    now = [0.0]
    readers = {
        zone: PoolReader(lambda address: replicas[address].text(), clock=lambda: now[0])
        for zone in ("a", "b")
    }
    for zone in ("a", "b"):
        readers[zone].read({f"model-fraud-zone-{zone}-0": zone})
    replicas["a"].calls(10, 0.01)
    replicas["b"].calls(30, 0.01)
    now[0] = 1.0
    found = {zone: readers[zone].read({f"model-fraud-zone-{zone}-0": zone}) for zone in ("a", "b")}
    assert found["a"].calls_per_s == pytest.approx(10.0)
    assert found["b"].calls_per_s == pytest.approx(30.0)
