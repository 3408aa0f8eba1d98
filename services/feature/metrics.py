"""The feature service's own Prometheus metrics, per view, beside the RPC metrics every
service has.

| metric | type | labels |
| --- | --- | --- |
| servemesh_feature_reads_total | counter | view (GetFeatures reads that reached Redis) |
| servemesh_feature_entities_read_total | counter | view |
| servemesh_feature_misses_total | counter | view (entities the view does not hold) |
| servemesh_feature_stale_reads_total | counter | view, policy (rows older than max_age) |
| servemesh_feature_redis_read_seconds | histogram | view (the read's MGET round trips) |
| servemesh_feature_replica_lag_seconds | gauge | zone (replicated store; +Inf: link down) |

Only views of the spec are labelled: a read naming another view is refused before it
reaches the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# A Redis MGET on loopback takes ~0.15 ms; a busy or distant store, milliseconds.
REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


@dataclass
class _ViewMetrics:
    reads: Any
    entities: Any
    misses: Any
    redis_seconds: Any


class FeatureMetrics:
    """Per-view counters on `registry` (a service's own; a fresh one when none is given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._reads = Counter(
            "servemesh_feature_reads",
            "GetFeatures reads that reached the store, by view.",
            ["view"],
            registry=self.registry,
        )
        self._entities = Counter(
            "servemesh_feature_entities_read",
            "Entities asked for by reads that reached the store, by view.",
            ["view"],
            registry=self.registry,
        )
        self._misses = Counter(
            "servemesh_feature_misses",
            "Entities read that the view does not hold, by view.",
            ["view"],
            registry=self.registry,
        )
        self.stale_reads = Counter(
            "servemesh_feature_stale_reads",
            "Entities read whose stored row was older than their view's max_age, by view and "
            "policy.",
            ["view", "policy"],
            registry=self.registry,
        )
        self._redis_seconds = Histogram(
            "servemesh_feature_redis_read_seconds",
            "Seconds a read spent on Redis (its MGET round trips), by view.",
            ["view"],
            buckets=REDIS_BUCKETS,
            registry=self.registry,
        )
        self.replica_lag = Gauge(
            "servemesh_feature_replica_lag_seconds",
            "A replicated store: seconds since the zone's replica last heard from its "
            "primary (+Inf while the link is down), by zone.",
            ["zone"],
            registry=self.registry,
        )
        self._views: dict[str, _ViewMetrics] = {}

    def read(self, view: str, entities: int, misses: int, seconds: float) -> None:
        """Count one read of `entities` entities of `view`, `misses` of them absent."""
        bound = self._views.get(view)
        if bound is None:
            bound = self._views[view] = _ViewMetrics(
                reads=self._reads.labels(view),
                entities=self._entities.labels(view),
                misses=self._misses.labels(view),
                redis_seconds=self._redis_seconds.labels(view),
            )
        bound.reads.inc()
        bound.entities.inc(entities)
        if misses:
            bound.misses.inc(misses)
        bound.redis_seconds.observe(seconds)
