"""The error-budget gate: how much of a model's SLO budget is left, and how fast it burns.

A model's SLO (`rollout.slos.<model>`) has two objectives with a budget each over the SLO's
window: availability (failed and degraded calls; 1 - availability of all calls may be bad)
and latency (calls slower than p99_ms; 1% may be). The budget left is 1 - bad / allowed; the
gate's number is the smaller of the two. `servemesh.slo_rules` holds the definitions
(which codes, which histogram bucket, the burn-rate windows) and renders them as recording
rules; this module reads the same expressions from the mesh's Prometheus, or, when the mesh
runs none, counts from the gateways' own /metrics since they started.

A rollout is refused when a budget is spent (left <= 0) or an objective burns fast: both of
the fast condition's windows over its threshold. The slow burn is reported, not enforced.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from servemesh.contract.errors import ServemeshError
from servemesh.contract.wire import SLI_FAILURE_CODES
from servemesh.observe.prom_query import PromClient, PrometheusError
from servemesh.observe.scrape import Sample, scrape
from servemesh.slo_rules import (
    OBJECTIVES,
    OIP_INFERS,
    OIP_SECONDS,
    PREDICT,
    PREDICT_SECONDS,
    BurnWindows,
    Objective,
    allowed_ratio,
    burn_rate_expr,
    burn_windows,
    grown_expr,
    prom_duration,
    slo_selectors,
    slow_bound_s,
)
from servemesh.spec import ResolvedSpec
from servemesh.spec.durations import duration_seconds
from servemesh.spec.rollout_plan import SloSpec
from servemesh.state.paths import MeshPaths

PROMETHEUS = "prometheus"
COUNTERS = "counters"
START_TIME = "process_start_time_seconds"
_FAILED = frozenset(SLI_FAILURE_CODES)


class BudgetUnreadable(ServemeshError, RuntimeError):
    """Neither Prometheus nor any gateway could say how much budget is left."""


@dataclass(frozen=True)
class ObjectiveBudget:
    """One objective's calls and bad calls over the span the reading covers."""

    objective: Objective
    total: float
    bad: float
    allowed_ratio: float

    @property
    def allowed(self) -> float:
        return self.allowed_ratio * self.total

    @property
    def left(self) -> float:
        """1 - bad / allowed; a span without calls spent nothing."""
        if self.total <= 0:
            return 1.0
        return 1.0 - self.bad / self.allowed

    @property
    def burn(self) -> float:
        """The burn rate over the whole span (1.0: spending exactly the allowed share)."""
        return 1.0 - self.left


@dataclass(frozen=True)
class BudgetReading:
    """A model's error budget at one moment, and where the numbers came from."""

    model: str
    slo: SloSpec
    source: str  # PROMETHEUS or COUNTERS
    span: str  # what the counts cover, in words: "over the last 1h"
    objectives: tuple[ObjectiveBudget, ...]
    fast: BurnWindows
    slow: BurnWindows
    # (objective, window) -> burn rate; empty when read from counters (one span only).
    burn: Mapping[tuple[str, str], float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def left(self) -> float:
        return min(o.left for o in self.objectives)

    @property
    def spent(self) -> bool:
        return self.left <= 0

    def burning(self, condition: BurnWindows) -> list[str]:
        """The objectives whose burn is over `condition`'s threshold in both its windows."""
        return [
            objective
            for objective in OBJECTIVES
            if self.burn.get((objective, condition.long), 0.0) > condition.threshold
            and self.burn.get((objective, condition.short), 0.0) > condition.threshold
        ]

    @property
    def refuses(self) -> bool:
        return self.spent or bool(self.burning(self.fast))

    def detail(self) -> str:
        """One line naming the budget left, each objective's numbers and the burn rates."""
        head = f"budget left {_percent(self.left)} {self.span}"
        if self.spent:
            head = f"budget spent: {head}"
        elif self.burning(self.fast):
            burning = ", ".join(self.burning(self.fast))
            head = f"fast burn over {_number(self.fast.threshold)} ({burning}): {head}"
        parts = [head, f"({'; '.join(self._objective_text(o) for o in self.objectives)})"]
        if self.burn:
            parts.append(f"; {self._burn_text(self.fast)}; {self._burn_text(self.slow)}")
        else:
            rates = ", ".join(f"{o.objective} {_number(o.burn)}" for o in self.objectives)
            parts.append(f"; burn since start: {rates}")
        line = " ".join(parts[:2]) + "".join(parts[2:])
        return line + "".join(f"; {note}" for note in self.notes)

    def _objective_text(self, o: ObjectiveBudget) -> str:
        if o.objective == "availability":
            what = f"{_count(o.bad)} failed or degraded of {_count(o.total)} calls"
            allowed = f"{_count(o.allowed)} allowed at {self.slo.availability * 100:g}%"
        else:
            bound = slow_bound_s(self.slo.p99_ms)
            over = "no finite bucket" if math.isinf(bound) else f"{bound * 1000:g} ms"
            what = (
                f"{_count(o.bad)} slower than {self.slo.p99_ms:g} ms (over {over}) "
                f"of {_count(o.total)}"
            )
            allowed = f"{_count(o.allowed)} allowed"
        return f"{o.objective} {_percent(o.left)} left: {what}, {allowed}"

    def _burn_text(self, condition: BurnWindows) -> str:
        rates = ", ".join(
            f"{objective} "
            f"{_number(self.burn.get((objective, condition.short), 0.0))}/"
            f"{_number(self.burn.get((objective, condition.long), 0.0))}"
            for objective in OBJECTIVES
        )
        return (
            f"{condition.name} burn over {condition.short}/{condition.long} "
            f"(limit {_number(condition.threshold)}): {rates}"
        )


def _percent(ratio: float) -> str:
    return f"{ratio:.1%}"


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".") if math.isfinite(value) else str(value)


def _count(value: float) -> str:
    return f"{value:,.0f}" if abs(value - round(value)) < 0.05 else f"{value:,.1f}"


# --- where the numbers come from --------------------------------------------------------


def running_prometheus(spec: ResolvedSpec) -> str | None:
    """The address of the Prometheus the mesh runs (its endpoints.json says), or None."""
    endpoints = MeshPaths(Path(spec.state_dir)).endpoints
    try:
        address = json.loads(endpoints.read_text()).get(PROMETHEUS)
    except (OSError, ValueError):
        return None
    return str(address) if address else None


def _scalar(client: PromClient, expr: str) -> float:
    """A query's one value; 0 when it has none (no series: nothing happened)."""
    values = [value for _, value in client.query(expr)]
    return sum(values) if values else 0.0


def read_from_prometheus(
    client: PromClient, model: str, slo: SloSpec, scrape_interval_s: float, retention_s: float
) -> BudgetReading:
    """Counts over the SLO's window and every burn rate, from the mesh's Prometheus."""
    window = prom_duration(slo.window_s)
    selectors = slo_selectors(model, slo)

    def grown(name: str) -> float:
        return _scalar(client, grown_expr(selectors[name], window))

    total, timed = grown("total"), grown("timed")
    bad = grown("failed") + grown("degraded")
    slow_calls = max(0.0, timed - grown("fast"))
    objectives = (
        ObjectiveBudget("availability", total, bad, allowed_ratio(slo, "availability")),
        ObjectiveBudget("latency", timed, slow_calls, allowed_ratio(slo, "latency")),
    )
    fast, slow = burn_windows(slo.window_s, scrape_interval_s)
    burn: dict[tuple[str, str], float] = {}
    for objective in OBJECTIVES:
        for span in {fast.long, fast.short, slow.long, slow.short}:
            burn[(objective, span)] = _scalar(client, burn_rate_expr(model, slo, objective, span))
    notes = []
    if retention_s < slo.window_s:
        notes.append(
            f"Prometheus keeps {prom_duration(retention_s)} of the {window} window "
            "(metrics.retention)"
        )
    return BudgetReading(
        model=model,
        slo=slo,
        source=PROMETHEUS,
        span=f"over the last {slo.window}",
        objectives=objectives,
        fast=fast,
        slow=slow,
        burn=burn,
        notes=tuple(notes),
    )


def count_from_samples(
    samples: Iterable[Sample], model: str, slo: SloSpec
) -> tuple[ObjectiveBudget, ObjectiveBudget]:
    """Both objectives' counts from the gateways' counters (their totals since start):
    Predict's and OIP ModelInfer's, as the rules count them."""
    total = failed = degraded = timed = fast = 0.0
    bound = slow_bound_s(slo.p99_ms)
    for s in samples:
        if s.labels.get("model") != model:
            continue
        if s.name in (PREDICT, OIP_INFERS):
            total += s.value
            if s.labels.get("code") in _FAILED:
                failed += s.value
            elif s.labels.get("degraded") == "true":
                degraded += s.value
        elif s.name in (f"{PREDICT_SECONDS}_count", f"{OIP_SECONDS}_count"):
            timed += s.value
        elif (
            s.name in (f"{PREDICT_SECONDS}_bucket", f"{OIP_SECONDS}_bucket")
            and float(s.labels["le"]) == bound
        ):
            fast += s.value
    return (
        ObjectiveBudget(
            "availability", total, failed + degraded, allowed_ratio(slo, "availability")
        ),
        ObjectiveBudget("latency", timed, max(0.0, timed - fast), allowed_ratio(slo, "latency")),
    )


def read_from_gateways(
    spec: ResolvedSpec, model: str, slo: SloSpec, why: str, *, now: float | None = None
) -> BudgetReading:
    """Counts since the gateways started, from their own /metrics (no burn windows: one
    span only). `why` says why Prometheus was not read."""
    samples: list[Sample] = []
    silent: list[str] = []
    started: list[float] = []
    for inst in spec.instances():
        if inst.service != "gateway":
            continue
        try:
            found = scrape(spec.metrics_address_of(inst.name))
        except OSError:
            silent.append(inst.name)
            continue
        samples += found
        started += [s.value for s in found if s.name == START_TIME]
    if not samples:
        raise BudgetUnreadable(f"{why}, and no gateway answered /metrics ({', '.join(silent)})")
    age_s = (now if now is not None else time.time()) - min(started) if started else math.nan
    since = f"{prom_duration(max(1.0, round(age_s)))} ago" if math.isfinite(age_s) else "?"
    notes = [f"gateways not answering: {', '.join(silent)}"] if silent else []
    fast, slow = burn_windows(slo.window_s, spec.metrics.scrape_interval_s)
    return BudgetReading(
        model=model,
        slo=slo,
        source=COUNTERS,
        span=f"from the gateways' counters since start ({since}), {why}",
        objectives=count_from_samples(samples, model, slo),
        fast=fast,
        slow=slow,
        notes=tuple(notes),
    )


def read_budget(spec: ResolvedSpec, model: str, slo: SloSpec) -> BudgetReading:
    """The budget from the mesh's Prometheus when it runs and answers, else from the
    gateways' counters (the detail says which, and why)."""
    address = running_prometheus(spec)
    if address is None:
        return read_from_gateways(spec, model, slo, "Prometheus is not running")
    client = PromClient(address)
    try:
        return read_from_prometheus(
            client,
            model,
            slo,
            spec.metrics.scrape_interval_s,
            duration_seconds(spec.metrics.retention),
        )
    except PrometheusError as exc:
        return read_from_gateways(
            spec, model, slo, f"Prometheus at {address} did not answer ({_first_line(exc)})"
        )


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 160 else text[:157] + "..."
