"""What the caller paid: Predict as a zone's edge Envoy measured it.

Each replica measures only its own part of a call. The latency a caller pays also holds
the time a request waits between processes: in a gateway's event loop before its handler
runs, in Envoy's queues, on a CPU run queue. Under overload that wait can be most of it
while every replica's own p99 stays under its target. The edge Envoy sees the whole: its
gRPC statistics filter times every Predict from the moment it leaves for a gateway to the
last byte back (`cluster.gateway.grpc.servemesh.gateway.v1.Gateway.Predict.upstream_rq_time`,
a histogram in ms), and counts each answer by its gRPC status.

`EdgeReader.read` gives the interval since its last read: the p99 (interpolated in the
buckets as PromQL's histogram_quantile does), the share of calls that failed by the SLI's
codes, and calls per second. Envoy merges histograms on its stats flush (every 5 s by
default), so a round shorter than that may see no new calls in the histogram yet.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import grpc

from servemesh.contract.wire import GATEWAY_SERVICE, SLI_FAILURE_CODES
from servemesh.observe.scrape import quantile
from servemesh.proxy.admin import admin_request

# The edge's cluster of gateways, and the prefix of its Predict statistics.
EDGE_GATEWAY_CLUSTER = "gateway"
PREDICT_STATS = f"cluster.{EDGE_GATEWAY_CLUSTER}.grpc.{GATEWAY_SERVICE}.Predict."
PREDICT_TIME = f"{PREDICT_STATS}upstream_rq_time"
_FAILED_CODES = {str(grpc.StatusCode[name].value[0]) for name in SLI_FAILURE_CODES}

Fetch = Callable[[str], str]


@dataclass(frozen=True)
class EdgeSignals:
    """One interval of Predict at an edge (None: no call measured in it)."""

    p99_ms: float | None
    error_ratio: float | None
    calls_per_s: float

    def as_dict(self) -> dict[str, float | None]:
        return {
            "p99_ms": None if self.p99_ms is None else round(self.p99_ms, 2),
            "error_ratio": None if self.error_ratio is None else round(self.error_ratio, 4),
            "calls_per_s": round(self.calls_per_s, 2),
        }


@dataclass(frozen=True)
class _Reading:
    at: float
    buckets: dict[float, float]  # upper bound (ms) -> cumulative count
    codes: dict[str, float]  # gRPC status number -> calls
    total: float


def admin_fetch(socket_path: Path | str, timeout_s: float = 2.0) -> Fetch:
    """Reads an Envoy's admin API over its Unix socket."""
    return lambda path: admin_request(socket_path, "GET", path, timeout_s)


def parse_stats(text: str) -> tuple[dict[float, float], dict[str, float], float]:
    """(Predict's cumulative time buckets, calls by status number, total calls) out of the
    admin API's JSON statistics."""
    buckets: dict[float, float] = {}
    codes: dict[str, float] = {}
    total = 0.0
    for entry in json.loads(text).get("stats", []):
        histograms = entry.get("histograms", []) if isinstance(entry, dict) else []
        for histogram in histograms if isinstance(histograms, list) else []:
            if histogram.get("name") == PREDICT_TIME:
                for bucket in histogram.get("buckets", []):
                    buckets[float(bucket["upper_bound"])] = float(bucket["cumulative"])
        name = entry.get("name", "") if isinstance(entry, dict) else ""
        if not name.startswith(PREDICT_STATS) or "value" not in entry:
            continue
        suffix = name.removeprefix(PREDICT_STATS)
        if suffix == "total":
            total = float(entry["value"])
        elif suffix.isdigit():
            codes[suffix] = float(entry["value"])
    return buckets, codes, total


class EdgeReader:
    """Keeps an edge's last reading; `read` gives Predict since then."""

    def __init__(self, fetch: Fetch, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._clock = clock
        self._last: _Reading | None = None

    def read(self) -> EdgeSignals | None:
        """The interval since the last read; None on the first read or when the edge does
        not answer (OSError: the scaler goes on with the replicas' own signals)."""
        path = "/stats?format=json&histogram_buckets=cumulative&filter=" + quote(
            f"^{PREDICT_STATS}".replace(".", r"\."), safe=""
        )
        buckets, codes, total = parse_stats(self._fetch(path))
        now = _Reading(self._clock(), buckets, codes, total)
        before, self._last = self._last, now
        if before is None or now.at <= before.at or now.total < before.total:
            return None  # the first reading, or an Envoy restarted (its counters from 0)
        calls = now.total - before.total
        failed = sum(
            now.codes.get(code, 0.0) - before.codes.get(code, 0.0) for code in _FAILED_CODES
        )
        moved = {le: count - before.buckets.get(le, 0.0) for le, count in now.buckets.items()}
        p99 = quantile(0.99, moved) if moved else math.nan
        return EdgeSignals(
            p99_ms=None if math.isnan(p99) else p99,
            error_ratio=failed / calls if calls else None,
            calls_per_s=calls / (now.at - before.at),
        )
