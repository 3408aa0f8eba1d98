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
    servemesh_scaler_edge{zone,signal}                             Predict at the zone's edge:
                                                                   p99_ms, error_ratio,
                                                                   calls_per_s
    servemesh_scaler_host_busy_ratio                               the host's CPU, 0..1
    servemesh_scaler_host_runnable                                 its run queue
    servemesh_scaler_host_headroom_cores                           cores' worth left idle
    servemesh_scaler_host_saturated                                1: no headroom (host.py)
    servemesh_scaler_no_headroom_total{pool,zone}                  scale-ups held for it

`pool` is what is scaled: a model pool by its processes' prefix (model-fraud), gateway or
feature.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from servemesh.scaling.decide import Decision
from servemesh.scaling.edge import EdgeSignals
from servemesh.scaling.host import HostLoad

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
        self.edge = Gauge(
            "servemesh_scaler_edge", "Predict at the zone's edge Envoy, as the last round read it",
            ["zone", "signal"], registry=r,
        )  # fmt: skip
        self.host_busy = Gauge(
            "servemesh_scaler_host_busy_ratio", "Share of the host's CPU busy since the last round",
            registry=r,
        )  # fmt: skip
        self.host_runnable = Gauge(
            "servemesh_scaler_host_runnable", "Threads running or waiting to run on the host",
            registry=r,
        )  # fmt: skip
        self.host_headroom = Gauge(
            "servemesh_scaler_host_headroom_cores", "Cores' worth of CPU left idle on the host",
            registry=r,
        )  # fmt: skip
        self.host_saturated = Gauge(
            "servemesh_scaler_host_saturated",
            "1 while the host has no headroom: every core busy and a longer run queue",
            registry=r,
        )
        self.starved = Counter(
            "servemesh_scaler_no_headroom",
            "Rounds in which a pool's scale-up was held: no headroom on this host",
            ["pool", "zone"], registry=r,
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

    def observe_edge(self, zone: str, seen: EdgeSignals) -> None:
        for name, value in seen.as_dict().items():
            if value is None:
                with contextlib.suppress(KeyError):
                    self.edge.remove(zone, name)
            else:
                self.edge.labels(zone, name).set(value)

    def observe_host(self, load: HostLoad, saturated: bool) -> None:
        if load.busy is None:
            return  # the first reading: no interval yet
        self.host_busy.set(load.busy)
        self.host_runnable.set(load.runnable)
        self.host_headroom.set(load.headroom_cores or 0.0)
        self.host_saturated.set(1 if saturated else 0)

    def acted(self, decision: Decision, outcome: str) -> None:
        direction = "up" if decision.desired > decision.current else "down"
        done = "done" if outcome == "done" else "failed"
        self.decisions.labels(decision.pool, decision.zone, direction, done).inc()
