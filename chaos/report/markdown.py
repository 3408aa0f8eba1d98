"""The drill's report in words: `report.md`, what an SRE pastes into a postmortem.

Numbers are shown as `summary.json` holds them (rounded to 3 places first), so the words
and the data never disagree in the last digit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from servemesh.chaos.report.numbers import DrillSummary, SteadyState
from servemesh.load import WindowStats


def _num(value: float) -> float | None:
    """A float as summary.json holds it: rounded to 3 places, NaN (nothing measured) None."""
    return None if math.isnan(value) else round(value, 3)


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return (
            f"{value:.1f}{suffix}"
            if abs(value) >= 10 or value == int(value)
            else f"{value:.2f}{suffix}"
        )
    return f"{value}{suffix}"


def _shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}%" for k, v in shares.items()) or "—"


def _shares_counts(counts: dict[str, int]) -> str:
    shown = {k: v for k, v in counts.items() if v}
    return ", ".join(f"{k} {v}" for k, v in sorted(shown.items())) or "none"


def _mark(met: bool) -> str:
    return "✓" if met else "✗"


# One row of the phases table: its label and how a phase's numbers read in it.
PHASE_ROWS: list[tuple[str, Callable[[WindowStats], str]]] = [
    ("sent", lambda p: str(p.sent)),
    ("failed", lambda p: str(p.failed)),
    ("degraded", lambda p: str(p.degraded)),
    ("success", lambda p: _fmt(_num(p.success_pct), "%")),
    ("p50 / p99", lambda p: f"{_fmt(_num(p.p50_ms))} / {_fmt(_num(p.p99_ms))} ms"),
    ("served by zone", lambda p: _shares(p.zones)),
    ("answered by version", lambda p: _shares(p.versions)),
]


def _numbers(summary: DrillSummary) -> list[str]:
    n, config, guard = summary.numbers, summary.config, summary.guard
    recover = n.recovery.time_to_recover_s
    recover_text = _fmt(recover, " s") if recover is not None else "not recovered by the end"
    back = n.recovery.zones_back_s
    back_text = _fmt(back, " s after the faults") if back is not None else "not by the end"
    failures = ", ".join(f"{c} {k}" for c, k in n.failures_by_code.items())
    fallbacks = "; ".join(f"{count} `{why}`" for why, count in n.fallbacks_by_reason.items())
    return [
        f"# Drill: {summary.drill}",
        "",
        f"**Verdict: {summary.verdict.upper()}** — {summary.verdict_text}.",
        "",
        f"Started {summary.started}; mesh spec `{summary.spec}`; load "
        f"{config['rate']:g} calls/s (open loop, {config['load_timeout_s']:g} s "
        f"deadline); guard: abort below {guard.min_success_pct:g}% success over "
        f"{guard.for_s:g} s.",
        "",
        "![success rate, latency and traffic per zone; fault windows shaded](timeline.png)",
        "",
        "## The numbers",
        "",
        f"- requests sent: **{n.sent}**, answered {n.answered}, failed **{n.failed}**"
        + (f" ({failures})" if n.failures_by_code else "")
        + f", degraded (fallback) answers **{n.degraded}**"
        + (f" ({fallbacks})" if fallbacks else ""),
        f"- success over the whole drill: **{_fmt(n.success_pct, '%')}**",
        f"- seconds below the SLO ({config['slo_success_pct']:g}% answered, real "
        f"answers): {_fmt(n.recovery.slo_breach_s)}",
        "- time to recover (from the end of the faults until the SLO held for good): "
        f"**{recover_text}**",
        f"- traffic back in every zone: {back_text}",
        "",
    ]


def _phases(summary: DrillSummary) -> list[str]:
    phases = summary.phases
    lines = [
        "| | " + " | ".join(phases) + " |",
        "| --- | " + " | ".join("---" for _ in phases) + " |",
    ]
    for label, cell in PHASE_ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(p) for p in phases.values()) + " |")
    return lines


def _steady_state(before: SteadyState | None, after: SteadyState | None) -> list[str]:
    lines = ["", "## Steady state (the SLO)", ""]
    after_by_name = {p.name: p for p in (after.probes if after is not None else [])}
    lines += ["| probe | tolerance | before | after |", "| --- | --- | --- | --- |"]
    for probe in before.probes if before is not None else []:
        later = after_by_name.get(probe.name)
        cell_after = "not checked" if later is None else f"{later.value} {_mark(later.met)}"
        lines.append(
            f"| {probe.name} | {probe.tolerance} | {probe.value} "
            f"{_mark(probe.met)} | {cell_after} |"
        )
    return lines


def _windows(summary: DrillSummary) -> list[str]:
    lines = [
        "",
        "## Fault windows",
        "",
        "| fault | from (s) | to (s) | sent | success | p99 (ms) | served by zone |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in summary.windows:
        s = w.stats
        label = w.label.replace("|", "/")
        lines.append(
            f"| {label} | {round(s.start_s, 3):.1f} | {_fmt(_num(s.end_s))} | {s.sent} | "
            f"{_fmt(_num(s.success_pct), '%')} | {_fmt(_num(s.p99_ms))} | {_shares(s.zones)} |"
        )
    return lines


def _envoy_and_marks(summary: DrillSummary) -> list[str]:
    env = summary.envoy
    lines = [
        "",
        "## Envoy (since the drill started)",
        "",
        f"- retries (hedges included, where a route hedges): {_shares_counts(env['retries'])};"
        f" retried calls answered: {_shares_counts(env.get('retry_successes', {}))}",
        f"- outlier ejections: {_shares_counts(env['ejections'])}",
        f"- overflows (circuit breakers, retry budget): {_shares_counts(env['overflows'])}",
        "",
        "## What happened, in order",
        "",
        "| t (s) | what |",
        "| --- | --- |",
    ]
    for mark in summary.marks:
        lines.append(f"| {mark.at_s:.1f} | {mark.label} |")
    failed = [a for a in summary.activities if a.status not in ("succeeded", None)]
    if failed:
        lines += ["", "Activities that failed: " + ", ".join(f"`{a.name}`" for a in failed)]
    if summary.load_error:
        lines += ["", f"The load generator failed: {summary.load_error}"]
    return lines


FILES = [
    "",
    "## Files",
    "",
    "- `journal.json`: the Chaos Toolkit journal (with this summary under `servemesh`)",
    "- `summary.json`: these numbers as data; `timeline.png`: the picture above",
    "- `mesh/logs/`: every process's log (JSON lines), Envoy's access logs",
    "",
]


def markdown(summary: DrillSummary) -> str:
    lines = [
        *_numbers(summary),
        *_phases(summary),
        *_steady_state(summary.before, summary.after),
        *_windows(summary),
        *_envoy_and_marks(summary),
        *FILES,
    ]
    return "\n".join(lines)
