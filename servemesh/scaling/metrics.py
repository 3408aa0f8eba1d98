"""The scaler's metrics, in a registry of its own (its /metrics, scraped by the mesh's
Prometheus as job `servemesh-scaler`):

    servemesh_scaler_decisions_total{pool,zone,direction,outcome}  up | down; done | failed
    servemesh_scaler_replicas{pool,zone,state}                     in_rotation | standby
    servemesh_scaler_desired_replicas{pool,zone}                   what the last round asked for
    servemesh_scaler_floor_replicas{pool,zone}                     min, schedule or forecast
    servemesh_scaler_signal{pool,zone,signal}                      p99_ms, queue_depth, cpu,
                                                                   in_flight, error_ratio,
                                                                   calls_per_s
    servemesh_scaler_rounds_total{outcome}                         ok | failed | held

`pool` is what is scaled: a model pool by its processes' prefix (model-fraud), gateway or
feature.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from servemesh.scaling.decide import Decision

SIGNALS = ("p99_ms", "queue_depth", "cpu", "in_flight", "error_ratio", "calls_per_s")


class ScalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "servemesh_scaler_decisions", "Replica count changes, by direction and outcome",
            ["pool", "zone", "direction", "outcome"], registry=r,
        )  # fmt: skip
        self.replicas = Gauge(
            "servemesh_scaler_replicas", "Replicas of the pool's zone, in rotation or standby",
            ["pool", "zone", "state"], registry=r,
        )  # fmt: skip
        self.desired = Gauge(
            "servemesh_scaler_desired_replicas", "What the last round asked for",
            ["pool", "zone"], registry=r,
        )  # fmt: skip
        self.floor = Gauge(
            "servemesh_scaler_floor_replicas", "The highest floor (min, schedule, forecast)",
            ["pool", "zone"], registry=r,
        )  # fmt: skip
        self.signal = Gauge(
            "servemesh_scaler_signal", "The pool's signals as the last round read them",
            ["pool", "zone", "signal"], registry=r,
        )  # fmt: skip
        self.rounds = Counter(
            "servemesh_scaler_rounds", "Rounds, by outcome (held: scaling off, or an update)",
            ["outcome"], registry=r,
        )  # fmt: skip

    def observe(self, decision: Decision, rotation: int, standby: int) -> None:
        pool, zone = decision.pool, decision.zone
        self.replicas.labels(pool, zone, "in_rotation").set(rotation)
        self.replicas.labels(pool, zone, "standby").set(standby)
        self.desired.labels(pool, zone).set(decision.desired)
        self.floor.labels(pool, zone).set(decision.floor)
        measured = decision.signals.as_dict()
        for name in SIGNALS:
            value = measured.get(name)
            if value is not None:
                self.signal.labels(pool, zone, name).set(value)
                continue
            # Not measured this round (no calls for a p99): no stale value left behind.
            with contextlib.suppress(KeyError):
                self.signal.remove(pool, zone, name)

    def acted(self, decision: Decision, outcome: str) -> None:
        direction = "up" if decision.desired > decision.current else "down"
        done = "done" if outcome == "done" else "failed"
        self.decisions.labels(decision.pool, decision.zone, direction, done).inc()
