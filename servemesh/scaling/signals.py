"""The signals a pool is scaled on, read from its replicas' own /metrics (no Prometheus
needed): each round scrapes every replica of the pool in rotation, and the difference from
the previous round's scrape of the same replica gives the interval's numbers.

Per zone, of the pool's serving method (`SERVING_METHODS`: ModelInfer for model servers,
Predict for gateways, GetFeatures for feature services): its p99 as the replicas measure it
(histogram buckets summed over the zone's replicas, the quantile interpolated as PromQL's
histogram_quantile does), its calls in flight (the gauge, averaged over the replicas), the
failed share of its calls (wire's SLI failure codes) and calls per second; the batch queue
depth (model servers only; the gauge, averaged); CPU in cores per replica
(process_cpu_seconds_total over the interval). A replica seen for the first time has no
interval yet: its counters count from the next round, its gauges from now.

Keep one reader per pool and zone: a reader forgets the replicas a read does not name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from servemesh.contract.wire import FEATURE_SERVICE, GATEWAY_SERVICE, OIP_SERVICE, SLI_FAILURE_CODES
from servemesh.observe.scrape import Sample, delta, quantiles_by, sum_by
from servemesh.scaling.decide import PoolSignals

INFER = f"/{OIP_SERVICE}/ModelInfer"
# The method whose calls are a pool's load, by kind of replica.
SERVING_METHODS = {
    "model": INFER,
    "gateway": f"/{GATEWAY_SERVICE}/Predict",
    "feature": f"/{FEATURE_SERVICE}/GetFeatures",
}
RPC = "servemesh_rpc_requests_total"
RPC_SECONDS = "servemesh_rpc_duration_seconds"
IN_FLIGHT = "servemesh_rpc_in_flight"
QUEUE = "servemesh_model_queue_depth"
CPU = "process_cpu_seconds_total"
_FAILED = set(SLI_FAILURE_CODES)

Scrape = Callable[[str], list[Sample]]


@dataclass(frozen=True)
class Reading:
    at: float  # monotonic seconds
    samples: list[Sample]


class PoolReader:
    """Keeps each replica's previous scrape; `read` gives a zone's signals since then."""

    def __init__(
        self, scrape: Scrape, clock: Callable[[], float] = time.monotonic, method: str = INFER
    ) -> None:
        self._scrape = scrape
        self._clock = clock
        self._method = method
        self._previous: dict[str, Reading] = {}

    def read(self, replicas: Mapping[str, str]) -> PoolSignals:
        """`replicas`: instance -> its metrics address, every replica of one zone's pool in
        rotation. A replica that does not answer is left out of this round."""
        moved: list[Sample] = []
        queue: list[float] = []
        in_flight: list[float] = []
        cores: list[float] = []
        for name, address in sorted(replicas.items()):
            try:
                samples = self._scrape(address)
            except OSError:
                continue
            now = self._clock()
            queue.append(sum(s.value for s in samples if s.name == QUEUE))
            in_flight.append(
                sum(
                    s.value
                    for s in samples
                    if s.name == IN_FLIGHT and s.labels.get("method") == self._method
                )
            )
            before = self._previous.get(name)
            self._previous[name] = Reading(now, samples)
            if before is None or now <= before.at:
                continue
            changed = delta(before.samples, samples)
            moved += changed
            cpu = sum(s.value for s in changed if s.name == CPU)
            cores.append(cpu / (now - before.at))
            moved.append(Sample("_elapsed", {}, now - before.at))
        for gone in set(self._previous) - set(replicas):
            del self._previous[gone]
        if self._method != INFER:
            queue = []  # only model servers have a batch queue
        return summarize(len(replicas), moved, queue, cores, self._method, in_flight)


def summarize(
    replicas: int,
    moved: Sequence[Sample],
    queue: Sequence[float],
    cores: Sequence[float],
    method: str = INFER,
    in_flight: Sequence[float] = (),
) -> PoolSignals:
    """A zone's signals from its replicas' counter increases (`moved`, with one `_elapsed`
    sample per replica measured), queue and in-flight gauges and CPU per replica, for the
    pool's serving `method`."""

    def serving(labels: Mapping[str, str]) -> bool:
        return labels.get("method") == method

    calls = sum_by(moved, RPC, ("method",), serving).get((method,), 0.0)
    failed = sum(
        v for (code,), v in sum_by(moved, RPC, ("code",), serving).items() if code in _FAILED
    )
    elapsed = [s.value for s in moved if s.name == "_elapsed"]
    span = sum(elapsed) / len(elapsed) if elapsed else 0.0
    p99: float | None = None
    if calls:
        found = quantiles_by(moved, RPC_SECONDS, (), (0.99,), serving).get((), (math.nan,))
        p99 = None if math.isnan(found[0]) else found[0] * 1000
    return PoolSignals(
        replicas=replicas,
        p99_ms=p99,
        queue_depth=sum(queue) / len(queue) if queue else None,
        cpu=sum(cores) / len(cores) if cores else None,
        in_flight=sum(in_flight) / len(in_flight) if in_flight else None,
        error_ratio=failed / calls if calls else None,
        calls_per_s=calls / span if span else 0.0,
    )
