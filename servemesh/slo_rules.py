"""The mesh's recording rules, as PromQL: the SLIs, and the error budgets of the spec's SLOs.

The SLI group (RULES) computes the SLIs per model, version and zone from the gateways'
metrics, per method from every service's, and per cluster from Envoy's; the SLO group
(slo_rules) records each model's error-budget burn rates and budget left for the SLOs the
spec states (`rollout.slos`), which the rollout's error-budget gate reads
(docs/rollouts-gates.md), computing the same budgets from the same expressions.

Plain data from the spec: the mesh's Prometheus (servemesh.procs.prometheus) writes these
rules beside its config, and the compose topology mounts them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client.utils import floatToGoString

from servemesh.contract.wire import LATENCY_BUCKETS_S, SLI_FAILURE_CODES
from servemesh.spec import MeshSpec
from servemesh.spec.durations import duration_seconds
from servemesh.spec.rollout_plan import SloSpec

# The scrape job of every service instance (servemesh.procs.prometheus's config): the
# rules that read process metrics select it.
SERVICES_JOB = "servemesh"
# Over a minute: a 2 s scrape leaves ~30 points per series, enough for a rate and a p99.
WINDOW = "1m"
_FAILED = "|".join(SLI_FAILURE_CODES)
# Health checks and reflection are Envoy's and tools' calls, not the service's work.
_SERVED = 'method!~"/grpc\\\\..*"'


def _duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def _rule(record: str, expr: str) -> dict[str, str]:
    return {"record": record, "expr": " ".join(expr.split())}


def _ratio_ok(metric: str, by: str, where: str = "") -> str:
    sep = "," if where else ""
    return f"""
        sum by ({by}) (rate({metric}{{{where}{sep}code!~"{_FAILED}"}}[{WINDOW}]))
        / sum by ({by}) (rate({metric}{{{where}}}[{WINDOW}]))"""


def _quantile(q: float, histogram: str, by: str, where: str = "") -> str:
    buckets = f"rate({histogram}_bucket{{{where}}}[{WINDOW}])"
    return f"histogram_quantile({q}, sum by ({by}, le) ({buckets}))"


PREDICT = "servemesh_gateway_predictions_total"
PREDICT_SECONDS = "servemesh_gateway_predict_duration_seconds"
# The OIP ModelInfer calls callers make at the edge (services/gateway/metrics.py): an SLO
# counts them beside Predict.
OIP_INFERS = "servemesh_gateway_oip_infers_total"
OIP_SECONDS = "servemesh_gateway_oip_infer_duration_seconds"
RPC = "servemesh_rpc_requests_total"
RPC_SECONDS = "servemesh_rpc_duration_seconds"
BY_VERSION = "model, version, zone"
BY_METHOD = "service, method"

# The recording rules: (record, PromQL). Success means any status but SLI_FAILURE_CODES.
RULES: list[dict[str, str]] = [
    _rule(
        "servemesh:predict_requests:rate1m",
        f"sum by ({BY_VERSION}) (rate({PREDICT}[{WINDOW}]))",
    ),
    _rule("servemesh:predict_success_ratio:rate1m", _ratio_ok(PREDICT, BY_VERSION)),
    _rule(
        "servemesh:predict_degraded_ratio:rate1m",
        f"""sum by ({BY_VERSION}) (rate({PREDICT}{{degraded="true"}}[{WINDOW}]))
            / sum by ({BY_VERSION}) (rate({PREDICT}[{WINDOW}]))""",
    ),
    _rule("servemesh:predict_latency_p50:1m", _quantile(0.5, PREDICT_SECONDS, BY_VERSION)),
    _rule("servemesh:predict_latency_p99:1m", _quantile(0.99, PREDICT_SECONDS, BY_VERSION)),
    _rule(
        "servemesh:rpc_requests:rate1m",
        f"sum by ({BY_METHOD}, zone) (rate({RPC}{{{_SERVED}}}[{WINDOW}]))",
    ),
    _rule("servemesh:rpc_success_ratio:rate1m", _ratio_ok(RPC, f"{BY_METHOD}, zone", _SERVED)),
    _rule(
        "servemesh:rpc_latency_p99:1m",
        _quantile(0.99, RPC_SECONDS, f"{BY_METHOD}, zone", _SERVED),
    ),
    _rule(
        "servemesh:cpu_cores:rate1m",
        f'sum by (service) (rate(process_cpu_seconds_total{{job="{SERVICES_JOB}"}}[{WINDOW}]))',
    ),
    # Envoy's side: requests and p99 (milliseconds, Envoy's unit) per upstream cluster,
    # i.e. per model version and calling zone (cluster model-<m>-<v>-via-<zone>).
    _rule(
        "servemesh:envoy_cluster_requests:rate1m",
        f"sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_total[{WINDOW}]))",
    ),
    _rule(
        "servemesh:envoy_cluster_latency_p99_ms:1m",
        _quantile(0.99, "envoy_cluster_upstream_rq_time", "envoy_cluster_name"),
    ),
]


# --- error budgets: the SLOs of `rollout.slos` -------------------------------------------
#
# Each model's SLO has two objectives, each with its own budget over the SLO's window:
# - availability: bad calls are those that failed (a code in SLI_FAILURE_CODES, the same
#   failures as the success SLI) and those answered degraded (the spec's fallback score: the
#   caller got no prediction); a caller's own errors (INVALID_ARGUMENT, NOT_FOUND) spend no
#   budget. Allowed: (1 - availability) of all calls.
# - latency: bad calls are those slower than p99_ms; a p99 objective allows 1% of them.
#   Histograms count by bucket, so "slower than p99_ms" is "above the smallest bucket bound
#   at or above p99_ms": rounded up, a call between p99_ms and that bound counts as fast.
#
# Burn rate is the bad ratio over a window divided by the allowed ratio (1.0 spends the
# budget exactly over the SLO window). The windows follow the Google SRE workbook's
# multi-window alerts for a 30-day SLO, scaled to the SLO's window: a fast burn spends 2% of
# the budget in 1/720 of the window (1 h of 30 d; burn 14.4, checked over that and 1/12 of
# it, 5 m), a slow one 5% in 1/120 (6 h; burn 6, over that and 30 m). No window is shorter
# than four scrape intervals (a rate needs samples to diff); a window stretched by that floor
# lowers its threshold to keep the same share of the budget, never below 1.

SLO_RULES_GROUP = "servemesh-slo"
BURN_RATE = "servemesh:slo_burn_rate"
BUDGET_LEFT = "servemesh:slo_budget_remaining"
Objective = Literal["availability", "latency"]
OBJECTIVES: tuple[Objective, ...] = ("availability", "latency")
# A p99 objective: 1% of calls may be slower.
LATENCY_ALLOWED = 0.01
# (name, the SLO window over the long window, the share of the budget it spends there)
_BURN_SHAPES = (("fast", 720.0, 0.02), ("slow", 120.0, 0.05))
_MIN_SCRAPES_PER_WINDOW = 4


@dataclass(frozen=True)
class BurnWindows:
    """One multi-window burn-rate condition: it fires while both windows burn faster than
    `threshold`."""

    name: str  # "fast" or "slow"
    long_s: float
    short_s: float
    threshold: float

    @property
    def long(self) -> str:
        return prom_duration(self.long_s)

    @property
    def short(self) -> str:
        return prom_duration(self.short_s)


def prom_duration(seconds: float) -> str:
    """A PromQL range: whole seconds where exact ("300s"), else milliseconds."""
    whole = round(seconds)
    if math.isclose(seconds, whole, abs_tol=1e-9) and whole > 0:
        return f"{whole}s"
    return _duration(seconds)


def burn_windows(window_s: float, scrape_interval_s: float) -> tuple[BurnWindows, BurnWindows]:
    """The fast and slow burn conditions of an SLO over `window_s` (see above)."""
    floor = _MIN_SCRAPES_PER_WINDOW * scrape_interval_s
    found = []
    for name, divisor, share in _BURN_SHAPES:
        long_s = max(window_s / divisor, floor)
        short_s = max(long_s / 12, floor)
        found.append(BurnWindows(name, long_s, short_s, max(1.0, share * window_s / long_s)))
    fast, slow = found
    return fast, slow


def slow_bound_s(p99_ms: float) -> float:
    """The latency histogram's smallest bucket bound at or above `p99_ms` (seconds); +inf
    when the objective lies above every finite bound (then no call counts as slow)."""
    target = p99_ms / 1000.0
    return next((b for b in LATENCY_BUCKETS_S if b >= target - 1e-12), math.inf)


def _le_matcher(bound: float) -> str:
    # prometheus_client writes 1.0 as "1.0"; other writers (and Prometheus 3's
    # normalisation) may write "1": match either spelling.
    spellings = {floatToGoString(bound)}
    if math.isfinite(bound) and bound == int(bound):
        spellings |= {str(int(bound)), f"{int(bound)}.0"}
    # A regex inside a PromQL string: its backslashes doubled.
    return "|".join(sorted(re.escape(s).replace("\\", "\\\\") for s in spellings))


def _model(model: str) -> str:
    return f'model="{model}"'


def grown_expr(selector: str, window: str) -> str:
    """PromQL: how much the counters `selector` grew over `window`, summed; empty when no
    such series had a sample in the window.

    increase() counts only what a series grew after its first sample, so a series born
    inside the window (a canary's first failures, a burst of calls that fell between two
    scrapes) would count nothing for the calls before that sample, and a burst that never
    grew again would count nothing at all. Such a series adds its first value (a counter's
    minimum): it exists in the window and did not exist a window ago."""
    born = f"sum(min_over_time({selector}[{window}]) unless {selector} offset {window})"
    return f"(sum(increase({selector}[{window}])) + ({born} or vector(0)))"


def _grown_or_zero(selector: str, window: str) -> str:
    # A count that may have no series at all (a model that never failed): zero.
    return f"({grown_expr(selector, window)} or vector(0))"


def _either(*names: str) -> str:
    """A matcher for series of any of `names`: one selector, so each count stays one sum."""
    return f'__name__=~"{"|".join(names)}"'


def slo_selectors(model: str, slo: SloSpec) -> dict[str, str]:
    """The series each count reads: all calls, bad ones (failed, degraded), fast ones.
    Predict's and OIP ModelInfer's both: a model's callers spend its budget whichever
    protocol they speak. Only Predict answers degraded (OIP has no fallback)."""
    where = _model(model)
    fast_le = _le_matcher(slow_bound_s(slo.p99_ms))
    calls = _either(PREDICT, OIP_INFERS)
    return {
        "total": f"{{{calls},{where}}}",
        "failed": f'{{{calls},{where},code=~"{_FAILED}"}}',
        "degraded": f'{PREDICT}{{{where},code!~"{_FAILED}",degraded="true"}}',
        "timed": f"{{{_either(f'{PREDICT_SECONDS}_count', f'{OIP_SECONDS}_count')},{where}}}",
        "fast": (
            f"{{{_either(f'{PREDICT_SECONDS}_bucket', f'{OIP_SECONDS}_bucket')},"
            f'{where},le=~"{fast_le}"}}'
        ),
    }


def bad_ratio_expr(model: str, slo: SloSpec, objective: Objective, window: str) -> str:
    """PromQL: the share of `model`'s calls over `window` that spend `objective`'s budget.
    Empty (no sample) while the model had no calls in the window."""
    s = slo_selectors(model, slo)
    if objective == "availability":
        bad = f"{_grown_or_zero(s['failed'], window)} + {_grown_or_zero(s['degraded'], window)}"
        return f"({bad}) / {grown_expr(s['total'], window)}"
    # Above every finite bound the objective's bucket is +Inf: every call is fast, ratio 0.
    return f"1 - {grown_expr(s['fast'], window)} / {grown_expr(s['timed'], window)}"


def allowed_ratio(slo: SloSpec, objective: Objective) -> float:
    return 1.0 - slo.availability if objective == "availability" else LATENCY_ALLOWED


def burn_rate_expr(model: str, slo: SloSpec, objective: Objective, window: str) -> str:
    """PromQL: how fast `model` spends `objective`'s budget over `window` (1.0: exactly
    as fast as the SLO allows)."""
    allowed = allowed_ratio(slo, objective)
    return f"({bad_ratio_expr(model, slo, objective, window)}) / {allowed!r}"


def slo_rules(spec: MeshSpec) -> list[dict[str, Any]]:
    """Per model with an SLO: the burn rate of each objective over each window of the fast
    and slow conditions, and the budget left over the SLO's window (1 - its burn rate)."""
    rules: list[dict[str, Any]] = []
    for model, slo in sorted(spec.rollout.slos.items()):
        window = prom_duration(slo.window_s)
        conditions = burn_windows(slo.window_s, spec.metrics.scrape_interval_s)
        spans = sorted({w for c in conditions for w in (c.long, c.short)}, key=_span_seconds)
        for objective in OBJECTIVES:
            for span in spans:
                rule = _rule(BURN_RATE, burn_rate_expr(model, slo, objective, span))
                labels = {"model": model, "objective": objective, "window": span}
                rules.append({**rule, "labels": labels})
            budget = f"1 - ({burn_rate_expr(model, slo, objective, window)})"
            labels = {"model": model, "objective": objective, "window": window}
            rules.append({**_rule(BUDGET_LEFT, budget), "labels": labels})
    return rules


def _span_seconds(text: str) -> float:
    return duration_seconds(text)


# --- alerts: the multi-window, multi-burn-rate conditions, paging and ticketing -----------
#
# Each model with an SLO gets, per objective, the fast and the slow condition of
# burn_windows as an alert: it fires while the objective burns faster than the condition's
# threshold over both its windows (the long one says the burn is real, the short one that it
# is still going on, so the alert resolves soon after the burn stops). Fast: severity page
# (2% of the budget in an hour of a 30-day SLO); slow: severity ticket (5% in six hours).
# Alertmanager routes by severity (servemesh.procs.alertmanager). Every alert names its
# runbook.

SLO_ALERTS = {"fast": "ServemeshSLOFastBurn", "slow": "ServemeshSLOSlowBurn"}
SEVERITY = {"fast": "page", "slow": "ticket"}
SLO_RUNBOOK = "docs/runbooks/slo-burn.md"


def slo_alerts(spec: MeshSpec) -> list[dict[str, Any]]:
    """The fast- and slow-burn alerts of every model's SLO, per objective."""
    alerts: list[dict[str, Any]] = []
    for model, slo in sorted(spec.rollout.slos.items()):
        for condition in burn_windows(slo.window_s, spec.metrics.scrape_interval_s):
            threshold = floatToGoString(round(condition.threshold, 6))
            for objective in OBJECTIVES:
                where = f'model="{model}",objective="{objective}"'

                def over(window: str, where: str = where, threshold: str = threshold) -> str:
                    return f'{BURN_RATE}{{{where},window="{window}"}} > {threshold}'

                alerts.append(
                    {
                        "alert": SLO_ALERTS[condition.name],
                        "expr": f"{over(condition.long)} and ignoring(window) "
                        f"{over(condition.short)}",
                        "labels": {
                            "severity": SEVERITY[condition.name],
                            "model": model,
                            "objective": objective,
                        },
                        "annotations": {
                            "summary": f"{model}: {objective} budget burning over {threshold}x "
                            f"over {condition.long} and {condition.short}",
                            "description": f"{objective} objective of {model}'s SLO "
                            f"({_objective_text(slo, objective)} over {slo.window}); "
                            'burn rate now {{ $value | printf "%.1f" }}',
                            "runbook": SLO_RUNBOOK,
                        },
                    }
                )
    return alerts


def _objective_text(slo: SloSpec, objective: Objective) -> str:
    if objective == "availability":
        return f"availability {slo.availability}"
    return f"p99 under {slo.p99_ms:g} ms"


# --- cost: what a million predictions of each model cost, and an alert when it rises ----
#
# Over an hour, each model is given the CPU it caused: the model servers' cores split by its
# share of their compute seconds (servemesh_model_compute_seconds), the gateways' and
# feature services' by its share of the answered Predicts, and its model servers' GPUs (a
# replica reporting servemesh_model_on_gpu for it). Priced at the spec's `cost:`, over its
# answered Predicts. Envoy and Redis are not in it (their CPU is not in their metrics;
# `servemesh top` reads it from /proc). The mesh's external label `mesh` tells one
# environment's figures from another's.

COST_RULES_GROUP = "servemesh-cost"
COST_WINDOW = "1h"
COST_PER_MILLION = "servemesh:cost_per_million_predictions:rate1h"
COST_PER_HOUR = "servemesh:cost_per_hour:rate1h"
COST_ALERT = "ServemeshCostPerMillionRising"


def cost_rules(spec: MeshSpec) -> list[dict[str, Any]]:
    w = COST_WINDOW
    ok = f'sum by (model) (rate({PREDICT}{{code="OK"}}[{w}]))'
    compute = f"sum by (model) (rate(servemesh_model_compute_seconds_sum[{w}]))"

    def cores(services: str) -> str:
        where = f'job="{SERVICES_JOB}",service=~"{services}"'
        # No such process scraped (a mesh without feature services, say): none of its cost.
        return f"scalar(sum(rate(process_cpu_seconds_total{{{where}}}[{w}])) or vector(0))"

    model_cores = f"({compute} / scalar(sum({compute}))) * {cores('model')}"
    front_cores = f"({ok} / scalar(sum({ok}))) * {cores('gateway|feature')}"
    gpus = "count by (model) (servemesh_model_on_gpu == 1)"
    price = spec.cost
    rules: list[dict[str, Any]] = [
        _rule("servemesh:model_cpu_cores:rate1h", f"{model_cores} + {front_cores}"),
        _rule(
            COST_PER_HOUR,
            f"""servemesh:model_cpu_cores:rate1h * {floatToGoString(price.per_core_hour)}
                + on(model) ({gpus} * {floatToGoString(price.per_gpu_hour)}
                  or servemesh:model_cpu_cores:rate1h * 0)""",
        ),
        _rule(COST_PER_MILLION, f"{COST_PER_HOUR} / ({ok} * 3600) * 1e6"),
    ]
    rise = price.alert_weekly_rise
    if rise is not None:
        rules.append(
            {
                "alert": COST_ALERT,
                "expr": " ".join(
                    f"""{COST_PER_MILLION} > {floatToGoString(1 + rise)}
                        * ({COST_PER_MILLION} offset 1w)""".split()
                ),
                "for": "1h",
                "labels": {"severity": "ticket"},
                "annotations": {
                    "summary": f"{{{{ $labels.model }}}}: a million predictions cost more "
                    f"than {rise:.0%} above the same hour last week",
                },
            }
        )
    return rules


# --- drift: a model's live inputs moved from its reference ------------------------------
#
# The registry computes each referenced model's drift every `prediction_log.drift.interval`
# (registry/drift.py) and exports a PSI, a p-value and the values compared per feature. A
# feature drifts as `servemesh drift` says it does: PSI at or above `psi_drifting` with the
# test's p-value under `p_value`, over at least `min_rows` live values; held `alert_after`,
# it tickets (drift is a model-quality question for its owners, not an outage).

DRIFT_RULES_GROUP = "servemesh-drift"
DRIFT_ALERT = "ServemeshFeatureDrift"
DRIFT_RUNBOOK = "docs/runbooks/feature-drift.md"
DRIFT_PSI = "servemesh_feature_drift_psi"
DRIFT_P_VALUE = "servemesh_feature_drift_p_value"
DRIFT_ROWS = "servemesh_feature_drift_rows"


def drift_alerts(spec: MeshSpec) -> list[dict[str, Any]]:
    drift = spec.prediction_log.drift
    same = "on(model, version, feature)"
    expr = (
        f"{DRIFT_PSI} >= {floatToGoString(drift.psi_drifting)}"
        f" and {same} {DRIFT_P_VALUE} < {floatToGoString(drift.p_value)}"
        f" and {same} {DRIFT_ROWS} >= {drift.min_rows}"
    )
    return [
        {
            "alert": DRIFT_ALERT,
            "expr": expr,
            "for": prom_duration(duration_seconds(drift.alert_after)),
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "{{ $labels.model }}: feature {{ $labels.feature }} drifted from "
                "its reference",
                "description": 'PSI {{ $value | printf "%.2f" }} over the last '
                f"{drift.window} of {{{{ $labels.model }}}}'s calls (version "
                "{{ $labels.version }}; * is every version against the model's reference); "
                "`servemesh drift {{ $labels.model }}` shows every feature",
                "runbook": DRIFT_RUNBOOK,
            },
        }
    ]


# --- the host: no headroom for another replica ------------------------------------------
#
# The scaler sets servemesh_scaler_host_saturated to 1 while its host has every core busy
# and a run queue longer than them (servemesh/scaling/host.py): it then adds no replica on
# it. Held five minutes, that is capacity the mesh cannot give itself: a ticket.

HOST_RULES_GROUP = "servemesh-host"
HOST_ALERT = "ServemeshHostSaturated"
HOST_RUNBOOK = "docs/runbooks/host-saturated.md"
HOST_SATURATED = "servemesh_scaler_host_saturated"


def host_alerts() -> list[dict[str, Any]]:
    return [
        {
            "alert": HOST_ALERT,
            "expr": f"{HOST_SATURATED} == 1",
            "for": "5m",
            "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "the mesh's host has no headroom: the scaler adds no replica",
                "description": "every core busy and a run queue longer than the cores for 5 "
                "minutes; `servemesh scale status` shows the host and each zone's edge",
                "runbook": HOST_RUNBOOK,
            },
        }
    ]


def render_rules(spec: MeshSpec | None = None) -> dict[str, Any]:
    """The rules file: the SLI group, the SLO group when `spec` states SLOs, the cost and
    drift groups for `spec`'s prices and drift settings, and the host's headroom alert."""
    groups: list[dict[str, Any]] = [{"name": "servemesh-sli", "rules": RULES}]
    slo = [*slo_rules(spec), *slo_alerts(spec)] if spec is not None else []
    if slo:
        groups.append({"name": SLO_RULES_GROUP, "rules": slo})
    if spec is not None:
        groups.append({"name": COST_RULES_GROUP, "rules": cost_rules(spec)})
        groups.append({"name": DRIFT_RULES_GROUP, "rules": drift_alerts(spec)})
        groups.append({"name": HOST_RULES_GROUP, "rules": host_alerts()})
    return {"groups": groups}
