"""A drill's numbers and verdict, as typed records: what the report's words and picture show.

`summarize` reads the drill's recorded calls, fault windows and Envoy counters plus the
Chaos Toolkit journal (steady state before and after, activities) into a `DrillSummary`;
`as_dict()` is the JSON of `summary.json`. Every latency percentile comes from
servemesh.load's statistics, the same function `servemesh bench predict` uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from servemesh.load import Outcome, WindowStats, window_stats

if TYPE_CHECKING:
    from servemesh.chaos.drill import Drill

BUCKET_S = 1.0
# Recovery is judged on sliding windows this long: at 100 calls/s one stray failure in a
# 1 s bucket would read as a breach of a 99.5% SLO.
RECOVERY_WINDOW_S = 3.0

VERDICT_TEXT = {
    "held": "the steady state held before and after the faults",
    "deviated": "the steady state did not hold after the faults",
    "aborted": "the guard stopped the drill; rollbacks ran",
    "not-run": "the steady state did not hold before any fault; nothing was injected",
    "error": "the drill could not do what it describes",
    "interrupted": "the drill was interrupted; rollbacks ran",
}

Span = tuple[float, float]


# --- the records -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recovery:
    slo_breach_s: float  # seconds (whole buckets) below the SLO
    time_to_recover_s: float | None  # from the end of the faults; None: not by the end
    zones_back_s: float | None  # until every zone carried traffic again; None: not by the end

    def as_dict(self) -> dict[str, Any]:
        return {
            "slo_breach_s": self.slo_breach_s,
            "time_to_recover_s": self.time_to_recover_s,
            "zones_back_s": self.zones_back_s,
        }


@dataclass(frozen=True)
class ProbeCheck:
    """One steady-state probe as the journal recorded it."""

    name: str | None
    tolerance: Any
    value: Any
    met: bool
    status: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tolerance": self.tolerance,
            "value": self.value,
            "met": self.met,
            "status": self.status,
        }


@dataclass(frozen=True)
class SteadyState:
    met: bool
    probes: list[ProbeCheck]

    def as_dict(self) -> dict[str, Any]:
        return {"met": self.met, "probes": [p.as_dict() for p in self.probes]}


@dataclass(frozen=True)
class Numbers:
    """The whole drill's calls, and its recovery."""

    sent: int
    answered: int
    failed: int
    degraded: int
    success_pct: float | None  # rounded as in summary.json; None when nothing was sent
    failures_by_code: dict[str, int]
    recovery: Recovery
    fallbacks_by_reason: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "answered": self.answered,
            "failed": self.failed,
            "degraded": self.degraded,
            "success_pct": self.success_pct,
            "failures_by_code": self.failures_by_code,
            "fallbacks_by_reason": self.fallbacks_by_reason,
            **self.recovery.as_dict(),
        }


@dataclass(frozen=True)
class FaultWindowStats:
    """What callers saw while one fault window was open."""

    label: str
    stats: WindowStats

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, **self.stats.as_dict()}


@dataclass(frozen=True)
class GuardSummary:
    min_success_pct: float
    for_s: float
    max_p99_ms: float | None  # None: no latency guard
    tripped: bool
    reason: str
    at_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "min_success_pct": self.min_success_pct,
            "for_s": self.for_s,
            "max_p99_ms": self.max_p99_ms,
            "tripped": self.tripped,
            "reason": self.reason,
            "at_s": self.at_s,
        }


@dataclass(frozen=True)
class MarkRecord:
    at_s: float
    label: str
    kind: str  # activity, phase, guard

    def as_dict(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "label": self.label, "kind": self.kind}


@dataclass(frozen=True)
class Activity:
    name: str | None
    type: str | None
    status: str | None
    output: Any

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "status": self.status, "output": self.output}


@dataclass(frozen=True)
class Network:
    """loopback, or netns with the namespaces, NAT chains and zone addresses it used."""

    mode: str
    namespaces: Any = None
    nat_chains: Any = None
    addresses: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        if self.mode == "loopback":
            return {"mode": self.mode}
        return {
            "mode": self.mode,
            "namespaces": self.namespaces,
            "nat_chains": self.nat_chains,
            "addresses": self.addresses,
        }


@dataclass(frozen=True)
class DrillSummary:
    drill: str
    started: str  # ISO time, seconds
    spec: str
    config: dict[str, Any]
    verdict: str  # a key of VERDICT_TEXT
    verdict_text: str
    chaostoolkit_status: Any
    deviated: bool
    before: SteadyState | None
    after: SteadyState | None
    numbers: Numbers
    phases: dict[str, WindowStats]  # baseline, during faults, after faults, whole drill
    windows: list[FaultWindowStats]
    guard: GuardSummary
    envoy: dict[str, dict[str, int]]  # retries, ejections, overflows by kind of cluster
    marks: list[MarkRecord]
    activities: list[Activity]
    load_error: str
    network: Network

    def as_dict(self) -> dict[str, Any]:
        """The summary as data (summary.json, the journal's `servemesh` entry)."""
        return {
            "drill": self.drill,
            "started": self.started,
            "spec": self.spec,
            "config": self.config,
            "verdict": self.verdict,
            "verdict_text": self.verdict_text,
            "chaostoolkit_status": self.chaostoolkit_status,
            "deviated": self.deviated,
            "steady_state": {
                "before": None if self.before is None else self.before.as_dict(),
                "after": None if self.after is None else self.after.as_dict(),
            },
            "numbers": self.numbers.as_dict(),
            "phases": {name: stats.as_dict() for name, stats in self.phases.items()},
            "windows": [w.as_dict() for w in self.windows],
            "guard": self.guard.as_dict(),
            "envoy": self.envoy,
            "marks": [m.as_dict() for m in self.marks],
            "activities": [a.as_dict() for a in self.activities],
            "load_error": self.load_error,
            "network": self.network.as_dict(),
        }


# --- numbers -----------------------------------------------------------------------------------


def envoy_deltas(start: dict[str, int], end: dict[str, int]) -> dict[str, dict[str, int]]:
    """Retries, outlier ejections and overflows between two counter snapshots, summed by
    kind of cluster (model, feature, gateway, registry, shadow)."""
    suffixes = {
        # With hedging on a route, a try past its per-try timeout is retried beside the
        # first (a hedge): Envoy counts it as a retry, and the call, once answered, as a
        # retry success (whichever try answered first).
        "requests": (".upstream_rq_total",),
        "retries": (".upstream_rq_retry",),
        "retry_successes": (".upstream_rq_retry_success",),
        "ejections": (".outlier_detection.ejections_enforced_total",),
        "overflows": (
            ".upstream_rq_pending_overflow",
            ".upstream_cx_overflow",
            ".upstream_rq_retry_overflow",
        ),
    }
    delta: dict[str, dict[str, int]] = {k: {} for k in suffixes}
    for name, value in end.items():
        cluster = name.removeprefix("cluster.").split(".", 1)[0]
        kind = cluster.split("-", 1)[0]
        for what, ends in suffixes.items():
            if name.endswith(ends):
                delta[what][kind] = delta[what].get(kind, 0) + value - start.get(name, 0)
    return delta


def _spans(drill: Drill, end_s: float) -> list[Span]:
    return [(w.start_s, w.end_s if w.end_s is not None else end_s) for w in drill.windows]


def _in_spans(outcomes: Sequence[Outcome], spans: list[Span]) -> list[Outcome]:
    return [o for o in outcomes if any(a <= o.sent_s < b for a, b in spans)]


def buckets(outcomes: Sequence[Outcome], end_s: float, size: float = BUCKET_S) -> list[WindowStats]:
    count = max(1, math.ceil(end_s / size))
    return [window_stats(outcomes, i * size, (i + 1) * size) for i in range(count)]


def _meets(stats: WindowStats, slo: float) -> bool:
    if stats.sent == 0:
        return True
    degraded = 0.0 if stats.ok == 0 or math.isnan(stats.degraded_pct) else stats.degraded_pct
    return stats.success_pct >= slo and degraded <= 100 - slo


def recovery(
    outcomes: Sequence[Outcome],
    spans: list[Span],
    end_s: float,
    slo: float,
    baseline_zones: dict[str, float],
) -> Recovery:
    """Seconds of SLO breach, time from the end of the faults until the SLO held for good,
    and until every zone carried traffic again."""
    if not spans:
        return Recovery(slo_breach_s=0.0, time_to_recover_s=0.0, zones_back_s=0.0)
    first = min(a for a, _ in spans)
    last_end = max(b for _, b in spans)
    starts = [first + i * BUCKET_S for i in range(int((end_s - first) // BUCKET_S))]
    windows = [
        (t, window_stats(outcomes, t, min(t + RECOVERY_WINDOW_S, end_s)))
        for t in starts
        if t + 1.0 <= end_s
    ]
    bad = [t for t, s in windows if not _meets(s, slo)]
    breach = sum(1 for t in starts if not _meets(window_stats(outcomes, t, t + BUCKET_S), slo))
    if not bad:
        recover: float | None = 0.0
    elif bad[-1] + RECOVERY_WINDOW_S >= end_s - BUCKET_S:
        recover = None  # still breaching at the end of the drill
    else:
        recover = max(0.0, bad[-1] + BUCKET_S - last_end)
    # Traffic back: every zone that carried at least 10% before the faults carries at least
    # half its baseline share again, for good. Shares are judged on whole windows only: with
    # hedged calls the zone that answers first depends on the host's load, and a window cut
    # short by the drill's end is too few calls to call that a relapse.
    zones = {z: share for z, share in baseline_zones.items() if share >= 10.0}
    zones_back: float | None = 0.0
    if zones:
        after = [(t, s) for t, s in windows if t >= last_end and t + RECOVERY_WINDOW_S <= end_s]
        low = [
            t
            for t, s in after
            if sum(1 for o in outcomes if t <= o.sent_s < t + RECOVERY_WINDOW_S) >= 5
            and any(s.zones.get(z, 0.0) < share / 2 for z, share in zones.items())
        ]
        if not after:
            zones_back = None
        elif not low:
            zones_back = 0.0
        elif low[-1] + RECOVERY_WINDOW_S >= end_s - BUCKET_S:
            zones_back = None
        else:
            zones_back = round(low[-1] + BUCKET_S - last_end, 1)
    return Recovery(
        slo_breach_s=breach * BUCKET_S,
        time_to_recover_s=None if recover is None else round(recover, 1),
        zones_back_s=zones_back,
    )


def _steady(state: dict[str, Any] | None, config: dict[str, Any]) -> SteadyState | None:
    if not state:
        return None
    probes = []
    for run in state.get("probes", []):
        activity = run.get("activity", {})
        tolerance = activity.get("tolerance")
        if isinstance(tolerance, str) and tolerance.startswith("${") and tolerance.endswith("}"):
            tolerance = config.get(tolerance[2:-1], tolerance)
        probes.append(
            ProbeCheck(
                name=activity.get("name"),
                tolerance=tolerance,
                value=run.get("output"),
                met=bool(run.get("tolerance_met")),
                status=run.get("status"),
            )
        )
    return SteadyState(met=bool(state.get("steady_state_met")), probes=probes)


def _verdict(
    drill: Drill, journal: dict[str, Any], before: SteadyState | None, after: SteadyState | None
) -> tuple[str, str]:
    if drill.start_error:
        return "error", f"the drill could not start: {drill.start_error}"
    if drill.guard.tripped:
        at_s = drill.guard.at_s or 0.0
        return "aborted", (
            f"aborted by the guard at t={at_s:.1f} s: {drill.guard.reason}; "
            "injection stopped and the rollbacks ran"
        )
    if drill.failed_activity:
        return "error", f"an activity failed, the drill stopped: {drill.failed_activity}"
    if before is not None and not before.met:
        missed = [str(p.name) for p in before.probes if not p.met]
        return "not-run", f"{VERDICT_TEXT['not-run']} (missed: {', '.join(missed)})"
    if journal.get("deviated") or (after is not None and not after.met):
        missed = [
            f"{p.name} = {p.value} (tolerance {p.tolerance})"
            for p in (after.probes if after is not None else [])
            if not p.met
        ]
        return "deviated", f"{VERDICT_TEXT['deviated']}: {'; '.join(missed)}"
    status = journal.get("status")
    if status == "interrupted":
        return "interrupted", VERDICT_TEXT["interrupted"]
    if status in ("failed", "aborted"):
        return "error", f"Chaos Toolkit ended the experiment with status {status!r}"
    if after is None:
        return "error", "the steady state was not checked after the faults"
    return "held", VERDICT_TEXT["held"]


def _network(drill: Drill) -> Network:
    network = drill.network
    if network is None:
        return Network("loopback")
    return Network(
        "netns",
        namespaces=network.namespaces,
        nat_chains=network.nat_chains,
        addresses={z: network.address(z) for z in network.zones},
    )


def _baseline_end(drill: Drill, spans: list[Span], end_s: float) -> float:
    """The baseline runs until the first fault (else until the method began)."""
    first_fault = min((a for a, _ in spans), default=None)
    if first_fault is not None:
        return first_fault
    method_at = next((m.at_s for m in drill.marks if m.label == "method"), None)
    return method_at or end_s


def drill_recovery(drill: Drill, outcomes: Sequence[Outcome], end_s: float) -> Recovery:
    """The recovery numbers of a drill's calls sent before `end_s`: the drill's end for its
    report, or a moment ago while it runs (the recovery watch that ends once recovered)."""
    spans = _spans(drill, end_s)
    baseline = window_stats(outcomes, 0.0, _baseline_end(drill, spans, end_s))
    slo = float(drill.config["slo_success_pct"])
    return recovery(outcomes, spans, end_s, slo, baseline.zones)


def summarize(drill: Drill, journal: dict[str, Any]) -> DrillSummary:
    outcomes = drill.outcomes_final
    end_s = max((o.sent_s for o in outcomes), default=0.0) + 1e-6
    spans = _spans(drill, end_s)
    baseline = window_stats(outcomes, 0.0, _baseline_end(drill, spans, end_s))
    phases = {"baseline": baseline}
    if spans:
        phases["during faults"] = window_stats(_in_spans(outcomes, spans), 0, math.inf)
        last_end = max(b for _, b in spans)
        phases["after faults"] = window_stats(outcomes, last_end, end_s)
    whole = window_stats(outcomes, 0.0, end_s)
    phases["whole drill"] = whole
    before = _steady(journal.get("steady_states", {}).get("before"), drill.config)
    after = _steady(journal.get("steady_states", {}).get("after"), drill.config)
    verdict, text = _verdict(drill, journal, before, after)
    activities = [
        Activity(
            name=run.get("activity", {}).get("name"),
            type=run.get("activity", {}).get("type"),
            status=run.get("status"),
            output=run.get("output"),
        )
        for section in ("run", "rollbacks")
        for run in journal.get(section, [])
    ]
    return DrillSummary(
        drill=drill.experiment_title or drill.name,
        started=drill.started_at.isoformat(timespec="seconds"),
        spec=str(drill.spec_path),
        config={k: v for k, v in drill.config.items() if k != "out_dir"},
        verdict=verdict,
        verdict_text=text,
        chaostoolkit_status=journal.get("status"),
        deviated=bool(journal.get("deviated")),
        before=before,
        after=after,
        numbers=Numbers(
            sent=whole.sent,
            answered=whole.ok,
            failed=whole.failed,
            degraded=whole.degraded,
            success_pct=whole.as_dict()["success_pct"],
            failures_by_code=whole.codes,
            recovery=drill_recovery(drill, outcomes, end_s),
            fallbacks_by_reason=whole.fallbacks,
        ),
        phases=phases,
        windows=[
            FaultWindowStats(w.label, window_stats(outcomes, w.start_s, w.end_s or end_s))
            for w in drill.windows
        ],
        guard=GuardSummary(
            min_success_pct=drill.guard.min_success_pct,
            for_s=drill.guard.for_s,
            max_p99_ms=drill.guard.max_p99_ms or None,
            tripped=drill.guard.tripped,
            reason=drill.guard.reason,
            at_s=drill.guard.at_s,
        ),
        envoy=envoy_deltas(drill.counters_start, drill.counters_end),
        marks=[MarkRecord(m.at_s, m.label, m.kind) for m in drill.marks],
        activities=activities,
        load_error=drill.load.error if drill.load is not None else "",
        network=_network(drill),
    )


# --- the timeline's series ---------------------------------------------------------------------


@dataclass(frozen=True)
class Shade:
    """A fault window as the timeline shades it."""

    label: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    """Per-second series of a drill, for the picture: whole buckets only (a last, partial
    second would read as a drop in traffic)."""

    title: str
    slo_pct: float
    t: list[float]  # bucket mid-points
    success_pct: list[float]  # NaN where nothing was sent
    degraded_pct: list[float]
    p50_ms: list[float]
    p99_ms: list[float]
    zone_answers_per_s: dict[str, list[float]]  # real answers per zone, stacked in order
    degraded_per_s: list[float]
    failed_per_s: list[float]
    shades: list[Shade]
    marks: list[MarkRecord]


def timeline(
    summary: DrillSummary,
    outcomes: Sequence[Outcome],
    zones: Sequence[str],
    windows: Sequence[tuple[str, float, float | None]],
) -> Timeline:
    """The series the picture draws; `windows` are (label, start_s, end_s or None if still
    open) of the drill's fault windows."""
    end_s = max(BUCKET_S, math.floor(max((o.sent_s for o in outcomes), default=1.0)))
    series = buckets(outcomes, end_s)
    per_zone = {
        zone: [
            sum(
                1
                for o in outcomes
                if s.start_s <= o.sent_s < s.end_s and o.zone == zone and o.code == "OK"
            )
            / BUCKET_S
            for s in series
        ]
        for zone in zones
    }
    return Timeline(
        title=f"{summary.drill} — {summary.verdict.upper()}",
        slo_pct=float(summary.config["slo_success_pct"]),
        t=[s.start_s + BUCKET_S / 2 for s in series],
        success_pct=[s.success_pct if s.sent else math.nan for s in series],
        degraded_pct=[(s.degraded_pct if s.ok else 0.0) if s.sent else math.nan for s in series],
        p50_ms=[s.p50_ms for s in series],
        p99_ms=[s.p99_ms for s in series],
        zone_answers_per_s=per_zone,
        degraded_per_s=[s.degraded / BUCKET_S for s in series],
        failed_per_s=[s.failed / BUCKET_S for s in series],
        shades=[
            Shade(label, start, end if end is not None else end_s) for label, start, end in windows
        ],
        marks=summary.marks,
    )
