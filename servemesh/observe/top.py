"""`servemesh top`: the live mesh in one table: req/s, error ratio, p50/p99 per service, per
model version and per zone, and what a million predictions cost.

Two sources, one report: the mesh's Prometheus (rates over `window`) when it runs, else
every service's /metrics scraped twice `interval` apart (counters diffed, quantiles
estimated from the histogram buckets as PromQL's histogram_quantile does). Errors are the
statuses in wire.SLI_FAILURE_CODES; a caller's own errors (INVALID_ARGUMENT...) are not.
Health checks and reflection are left out of the services' rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from servemesh.contract.wire import SLI_FAILURE_CODES
from servemesh.observe.cpu import Cost, proc_cpu_seconds
from servemesh.observe.prom_query import PromClient, PrometheusError
from servemesh.observe.scrape import (
    Sample,
    delta,
    quantiles_by,
    scrape,
    sum_by,
)
from servemesh.spec import ResolvedSpec
from servemesh.state.running import RunningMesh

PREDICT = "servemesh_gateway_predictions_total"
PREDICT_SECONDS = "servemesh_gateway_predict_duration_seconds"
RPC = "servemesh_rpc_requests_total"
RPC_SECONDS = "servemesh_rpc_duration_seconds"
CPU = "process_cpu_seconds_total"
TIER_LOOKUPS = "servemesh_gateway_tier_lookups_total"
TIER_KEYS = ("model", "tier", "result")
ON_GPU = "servemesh_model_on_gpu"
# Processes whose own metrics carry no CPU counter: read from /proc by PID.
PROC_PARTS = ("envoy", "redis")
_FAILED = set(SLI_FAILURE_CODES)


@dataclass(frozen=True)
class Row:
    """One line of the table: what it is about, and its traffic."""

    key: dict[str, str]
    rps: float
    error_ratio: float | None
    p50_ms: float | None
    p99_ms: float | None

    def as_dict(self) -> dict[str, object]:
        return {
            **self.key,
            "rps": round(self.rps, 2),
            "error_ratio": _round(self.error_ratio, 4),
            "p50_ms": _round(self.p50_ms, 2),
            "p99_ms": _round(self.p99_ms, 2),
        }


@dataclass(frozen=True)
class TierRow:
    """One model's tier at the gateways: its lookups and how they ended, and the share of
    the model's answered Predicts that this tier answered."""

    model: str
    tier: str  # precomputed or cache
    lookups_per_s: float
    hit_ratio: float | None  # of its lookups: answered
    stale_ratio: float | None  # refused for their age
    skipped_ratio: float | None  # not made (the store unreachable, no time left)
    answered_share: float | None  # of the model's Predicts answered OK

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "tier": self.tier,
            "lookups_per_s": round(self.lookups_per_s, 2),
            "hit_ratio": _round(self.hit_ratio, 4),
            "stale_ratio": _round(self.stale_ratio, 4),
            "skipped_ratio": _round(self.skipped_ratio, 4),
            "answered_share": _round(self.answered_share, 4),
        }


def tier_rows(
    lookups: Mapping[tuple[str, ...], float],
    answered: Mapping[tuple[str, ...], float],
    seconds: float,
) -> list[TierRow]:
    """Rows from lookup counts by (model, tier, result) and OK Predicts by (model,)."""
    by_tier: dict[tuple[str, str], dict[str, float]] = {}
    for (model, tier, result), count in lookups.items():
        by_tier.setdefault((model, tier), {})[result] = count
    rows = []
    for (model, tier), results in sorted(by_tier.items()):
        total = sum(results.values())
        ok = answered.get((model,), 0.0)

        def share(
            result: str, total: float = total, results: dict[str, float] = results
        ) -> float | None:
            return results.get(result, 0.0) / total if total else None

        rows.append(
            TierRow(
                model=model,
                tier=tier,
                lookups_per_s=total / seconds if seconds else 0.0,
                hit_ratio=share("hit"),
                stale_ratio=share("stale"),
                skipped_ratio=share("skipped"),
                answered_share=results.get("hit", 0.0) / ok if ok else None,
            )
        )
    return rows


@dataclass
class TopReport:
    source: str  # "prometheus" or "metrics endpoints"
    seconds: float  # the span the rates cover
    services: list[Row] = field(default_factory=list)
    versions: list[Row] = field(default_factory=list)
    zones: list[Row] = field(default_factory=list)
    tiers: list[TierRow] = field(default_factory=list)
    cost: Cost | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "seconds": round(self.seconds, 3),
            "services": [r.as_dict() for r in self.services],
            "versions": [r.as_dict() for r in self.versions],
            "zones": [r.as_dict() for r in self.zones],
            "tiers": [r.as_dict() for r in self.tiers],
            "cost": self.cost.as_dict() if self.cost else None,
        }


def _round(value: float | None, digits: int) -> float | None:
    if value is None or math.isnan(value):
        return None
    return round(value, digits)


def _served(labels: Mapping[str, str]) -> bool:
    return not labels.get("method", "").startswith("/grpc.")


def _rows(
    keys: tuple[str, ...],
    total: Mapping[tuple[str, ...], float],
    failed: Mapping[tuple[str, ...], float],
    quantiles: Mapping[tuple[str, ...], tuple[float, ...]],
    seconds: float,
) -> list[Row]:
    rows = []
    for key in sorted(total):
        count = total[key]
        p50, p99 = quantiles.get(key, (math.nan, math.nan))
        rows.append(
            Row(
                key=dict(zip(keys, key, strict=True)),
                rps=count / seconds if seconds else 0.0,
                error_ratio=failed.get(key, 0.0) / count if count else None,
                p50_ms=p50 * 1000,
                p99_ms=p99 * 1000,
            )
        )
    return rows


# --- from the services' own /metrics ----------------------------------------------------


def scrape_mesh(spec: ResolvedSpec) -> list[Sample]:
    """Every instance's /metrics, each sample labelled service, instance and zone as
    Prometheus's targets are; an instance that does not answer is left out."""
    found: list[Sample] = []
    for inst in spec.instances():
        labels = {"service": inst.service, "instance": inst.name, "zone": inst.zone}
        try:
            found += scrape(spec.metrics_address_of(inst.name), extra=labels)
        except OSError:
            continue
    return found


def proc_times(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of the processes in PROC_PARTS (by name), from /proc."""
    found = {}
    for name in PROC_PARTS:
        pid = pids.get(name)
        seconds = proc_cpu_seconds(pid) if pid else None
        if seconds is not None:
            found[name] = seconds
    return found


@dataclass(frozen=True)
class MeshSnapshot:
    """The mesh's counters at one moment: every /metrics, and /proc for Envoy and Redis."""

    at: float
    samples: list[Sample]
    proc: dict[str, float]

    @classmethod
    def take(cls, spec: ResolvedSpec, pids: Mapping[str, int]) -> MeshSnapshot:
        at = time.monotonic()
        return cls(at=at, samples=scrape_mesh(spec), proc=proc_times(pids))


def cost_between(before: MeshSnapshot, after: MeshSnapshot, spec: ResolvedSpec) -> Cost:
    """CPU (and GPU) spent per successful prediction between two snapshots."""
    moved = delta(before.samples, after.samples)
    by_part = {k[0]: v for k, v in sum_by(moved, CPU, ("service",)).items()}
    for name, seconds in after.proc.items():
        by_part[name] = seconds - before.proc.get(name, seconds)
    ok = sum(sum_by(moved, PREDICT, (), lambda labels: labels.get("code") == "OK").values())
    gpus = {s.labels.get("instance") for s in after.samples if s.name == ON_GPU and s.value}
    return Cost(
        predictions=ok,
        cpu_seconds=sum(by_part.values()),
        cpu_by_part=by_part,
        gpus=len(gpus),
        seconds=after.at - before.at,
        price_per_core_hour=spec.cost.per_core_hour,
        price_per_gpu_hour=spec.cost.per_gpu_hour,
    )


def report_between(before: MeshSnapshot, after: MeshSnapshot, spec: ResolvedSpec) -> TopReport:
    """The report of what happened between two snapshots."""
    seconds = after.at - before.at
    moved = delta(before.samples, after.samples)
    qs = (0.5, 0.99)

    def failed(labels: Mapping[str, str]) -> bool:
        return labels.get("code") in _FAILED

    def served_failed(labels: Mapping[str, str]) -> bool:
        return _served(labels) and failed(labels)

    report = TopReport(source="metrics endpoints", seconds=seconds)
    keys: tuple[str, ...] = ("service",)
    report.services = _rows(
        keys,
        sum_by(moved, RPC, keys, _served),
        sum_by(moved, RPC, keys, served_failed),
        quantiles_by(moved, RPC_SECONDS, keys, qs, _served),
        seconds,
    )
    for attr, keys in (("versions", ("model", "version")), ("zones", ("zone",))):
        rows = _rows(
            keys,
            sum_by(moved, PREDICT, keys),
            sum_by(moved, PREDICT, keys, failed),
            quantiles_by(moved, PREDICT_SECONDS, keys, qs),
            seconds,
        )
        setattr(report, attr, rows)
    report.tiers = tier_rows(
        sum_by(moved, TIER_LOOKUPS, TIER_KEYS),
        sum_by(moved, PREDICT, ("model",), lambda labels: labels.get("code") == "OK"),
        seconds,
    )
    report.cost = cost_between(before, after, spec)
    return report


def measure_direct(spec: ResolvedSpec, pids: Mapping[str, int], interval_s: float) -> TopReport:
    before = MeshSnapshot.take(spec, pids)
    time.sleep(interval_s)
    return report_between(before, MeshSnapshot.take(spec, pids), spec)


# --- from Prometheus ---------------------------------------------------------------------


def _by(client: PromClient, expr: str, keys: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    return {tuple(m.get(k, "") for k in keys): v for m, v in client.query(expr)}


def _prom_rows(
    client: PromClient,
    counter: str,
    histogram: str,
    keys: tuple[str, ...],
    window: str,
    where: str = "",
) -> list[Row]:
    by = ", ".join(keys)
    sep = "," if where else ""
    failed = f'code=~"{"|".join(SLI_FAILURE_CODES)}"'
    rate = _by(client, f"sum by ({by}) (rate({counter}{{{where}}}[{window}]))", keys)
    bad = _by(client, f"sum by ({by}) (rate({counter}{{{where}{sep}{failed}}}[{window}]))", keys)
    quantiles: dict[tuple[str, ...], list[float]] = {}
    for q in (0.5, 0.99):
        expr = (
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({histogram}_bucket{{{where}}}[{window}])))"
        )
        for key, value in _by(client, expr, keys).items():
            quantiles.setdefault(key, []).append(value)
    rows = []
    for key in sorted(rate):
        p50, p99 = [*quantiles.get(key, []), math.nan, math.nan][:2]
        rows.append(
            Row(
                key=dict(zip(keys, key, strict=True)),
                rps=rate[key],
                error_ratio=bad.get(key, 0.0) / rate[key] if rate[key] else None,
                p50_ms=p50 * 1000,
                p99_ms=p99 * 1000,
            )
        )
    return rows


def measure_prometheus(
    client: PromClient,
    spec: ResolvedSpec,
    pids: Mapping[str, int],
    window_s: float,
    interval_s: float,
) -> TopReport:
    """Rates over the last `window_s` from Prometheus; Envoy's and Redis's CPU (which
    their metrics lack) from /proc over `interval_s`."""
    window = f"{round(window_s)}s"
    report = TopReport(source="prometheus", seconds=window_s)
    report.services = _prom_rows(
        client, RPC, RPC_SECONDS, ("service",), window, 'method!~"/grpc\\\\..*"'
    )
    report.versions = _prom_rows(client, PREDICT, PREDICT_SECONDS, ("model", "version"), window)
    report.zones = _prom_rows(client, PREDICT, PREDICT_SECONDS, ("zone",), window)
    # Rates times the window: the counts tier_rows takes (its shares are rate ratios).
    report.tiers = tier_rows(
        {
            k: v * window_s
            for k, v in _by(
                client, f"sum by (model, tier, result) (rate({TIER_LOOKUPS}[{window}]))", TIER_KEYS
            ).items()
        },
        {
            k: v * window_s
            for k, v in _by(
                client, f'sum by (model) (rate({PREDICT}{{code="OK"}}[{window}]))', ("model",)
            ).items()
        },
        window_s,
    )
    before = proc_times(pids)
    started = time.monotonic()
    time.sleep(interval_s)
    after = proc_times(pids)
    elapsed = time.monotonic() - started
    cores = {
        k[0]: v
        for k, v in _by(client, f"sum by (service) (rate({CPU}[{window}]))", ("service",)).items()
    }
    cores.pop("envoy", None)  # Envoy's stats carry no process CPU; /proc says it
    for name, seconds in after.items():
        cores[name] = (seconds - before.get(name, seconds)) / elapsed if elapsed else 0.0
    ok_rate = sum(_by(client, f'sum(rate({PREDICT}{{code="OK"}}[{window}]))', ()).values())
    gpus = len(client.query(f"max by (instance) ({ON_GPU}) == 1"))
    report.cost = Cost(
        predictions=ok_rate * window_s,
        cpu_seconds=sum(cores.values()) * window_s,
        cpu_by_part={k: v * window_s for k, v in cores.items()},
        gpus=gpus,
        seconds=window_s,
        price_per_core_hour=spec.cost.per_core_hour,
        price_per_gpu_hour=spec.cost.per_gpu_hour,
    )
    return report


# --- the command -------------------------------------------------------------------------


def measure(mesh: RunningMesh, source: str, window_s: float, interval_s: float) -> TopReport:
    """One report: from Prometheus when `source` allows and it answers, else direct."""
    prometheus = mesh.prometheus()
    if source != "direct" and prometheus is not None:
        client = PromClient(prometheus)
        try:
            return measure_prometheus(client, mesh.spec, mesh.pids(), window_s, interval_s)
        except PrometheusError:
            if source == "prometheus":
                raise
    elif source == "prometheus":
        raise PrometheusError("this mesh runs no Prometheus (metrics.prometheus, or no binary)")
    return measure_direct(mesh.spec, mesh.pids(), interval_s)


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


# What an empty label means in the gateways' Predict counters (services/gateway/metrics.py):
# a call that failed before any version was chosen (an unknown entity, a bad input), or one
# naming a model the spec does not have.
_EMPTY_LABELS = {
    "version": "(none: failed before routing)",
    "model": "(not in the spec)",
}


def render(report: TopReport) -> Any:
    """The report as rich renderables (tables and the cost line)."""
    from rich.console import Group
    from rich.table import Table

    parts: list[Any] = []
    sections = (
        ("services (their own RPCs; health checks left out)", report.services),
        ("model versions (Predict at the gateways)", report.versions),
        ("zones (Predict at the gateways of each zone)", report.zones),
    )
    for title, rows in sections:
        table = Table(title=title, title_justify="left")
        names = list(rows[0].key) if rows else ["-"]
        for name in names:
            table.add_column(name)
        for column in ("req/s", "errors", "p50 ms", "p99 ms"):
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(
                *(row.key[n] or _EMPTY_LABELS.get(n, "(none)") for n in names),
                f"{row.rps:.1f}",
                _ratio(row.error_ratio),
                _ms(row.p50_ms),
                _ms(row.p99_ms),
            )
        parts.append(table)
    if report.tiers:
        table = Table(title="tiers (lookups at the gateways)", title_justify="left")
        for column in ("model", "tier"):
            table.add_column(column)
        for column in ("lookups/s", "hit", "stale", "skipped", "of answers"):
            table.add_column(column, justify="right")
        for tier in report.tiers:
            table.add_row(
                tier.model,
                tier.tier,
                f"{tier.lookups_per_s:.1f}",
                _ratio(tier.hit_ratio),
                _ratio(tier.stale_ratio),
                _ratio(tier.skipped_ratio),
                _ratio(tier.answered_share),
            )
        parts.append(table)
    cost = report.cost
    if cost is not None and cost.as_dict()["cpu_seconds_per_million"] is None:
        parts.append("cost: - (no predictions answered in the window)")
    elif cost is not None:
        per_million = cost.as_dict()
        parts.append(
            f"cost: {per_million['cpu_seconds_per_million']} CPU-s per million predictions "
            f"(${per_million['price_per_million']} at ${cost.price_per_core_hour}/core-hour"
            + (f", {cost.gpus} GPU(s) at ${cost.price_per_gpu_hour}/GPU-hour" if cost.gpus else "")
            + ")"
        )
    parts.append(f"source: {report.source}, over {report.seconds:.1f} s")
    return Group(*parts)
