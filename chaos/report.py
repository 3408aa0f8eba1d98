"""A drill's verdict, numbers and report: what an SRE pastes into a postmortem.

`summarize` reads the drill's recorded calls, fault windows and Envoy counters plus the Chaos
Toolkit journal (steady state before and after, activities) into one JSON-able summary;
`write_report` writes it as `summary.json`, `journal.json`, a Markdown `report.md` and a
`timeline.png` (success rate, p99, traffic per zone, each fault window shaded).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servemesh.chaos.load import WindowStats, window_stats
from servemesh.loadgen import Outcome

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


# --- numbers -----------------------------------------------------------------------------------


def envoy_deltas(start: dict[str, int], end: dict[str, int]) -> dict[str, dict[str, int]]:
    """Retries, outlier ejections and overflows between two counter snapshots, summed by
    kind of cluster (model, feature, gateway, registry, shadow)."""
    suffixes = {
        "retries": (".upstream_rq_retry",),
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


def _spans(drill: Drill, end_s: float) -> list[tuple[float, float]]:
    return [(w.start_s, w.end_s if w.end_s is not None else end_s) for w in drill.windows]


def _in_spans(outcomes: Sequence[Outcome], spans: list[tuple[float, float]]) -> list[Outcome]:
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
    spans: list[tuple[float, float]],
    end_s: float,
    slo: float,
    baseline_zones: dict[str, float],
) -> dict[str, Any]:
    """Seconds of SLO breach, time from the end of the faults until the SLO held for good,
    and until every zone carried traffic again."""
    if not spans:
        return {"slo_breach_s": 0.0, "time_to_recover_s": 0.0, "zones_back_s": 0.0}
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
    # half its baseline share again, for good.
    zones = {z: share for z, share in baseline_zones.items() if share >= 10.0}
    zones_back: float | None = 0.0
    if zones:
        after = [(t, s) for t, s in windows if t >= last_end]
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
    return {
        "slo_breach_s": breach * BUCKET_S,
        "time_to_recover_s": None if recover is None else round(recover, 1),
        "zones_back_s": zones_back,
    }


def _steady(state: dict[str, Any] | None, config: dict[str, Any]) -> dict[str, Any] | None:
    if not state:
        return None
    probes = []
    for run in state.get("probes", []):
        activity = run.get("activity", {})
        tolerance = activity.get("tolerance")
        if isinstance(tolerance, str) and tolerance.startswith("${") and tolerance.endswith("}"):
            tolerance = config.get(tolerance[2:-1], tolerance)
        probes.append(
            {
                "name": activity.get("name"),
                "tolerance": tolerance,
                "value": run.get("output"),
                "met": bool(run.get("tolerance_met")),
                "status": run.get("status"),
            }
        )
    return {"met": bool(state.get("steady_state_met")), "probes": probes}


def _verdict(drill: Drill, journal: dict[str, Any], before: Any, after: Any) -> tuple[str, str]:
    if drill.start_error:
        return "error", f"the drill could not start: {drill.start_error}"
    if drill.guard.tripped:
        return "aborted", (
            f"aborted by the guard at t={drill.guard.at_s:.1f} s: {drill.guard.reason}; "
            "injection stopped and the rollbacks ran"
        )
    if drill.failed_activity:
        return "error", f"an activity failed, the drill stopped: {drill.failed_activity}"
    if before is not None and not before["met"]:
        missed = [p["name"] for p in before["probes"] if not p["met"]]
        return "not-run", f"{VERDICT_TEXT['not-run']} (missed: {', '.join(missed)})"
    if journal.get("deviated") or (after is not None and not after["met"]):
        missed = [
            f"{p['name']} = {p['value']} (tolerance {p['tolerance']})"
            for p in (after or {"probes": []})["probes"]
            if not p["met"]
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


def summarize(drill: Drill, journal: dict[str, Any]) -> dict[str, Any]:
    outcomes = drill.outcomes_final
    end_s = max((o.sent_s for o in outcomes), default=0.0) + 1e-6
    spans = _spans(drill, end_s)
    method_at = next((m.at_s for m in drill.marks if m.label == "method"), None)
    first_fault = min((a for a, _ in spans), default=None)
    baseline_end = first_fault if first_fault is not None else (method_at or end_s)
    baseline = window_stats(outcomes, 0.0, baseline_end)
    phases: dict[str, Any] = {"baseline": baseline.as_dict()}
    if spans:
        phases["during faults"] = window_stats(_in_spans(outcomes, spans), 0, math.inf).as_dict()
        last_end = max(b for _, b in spans)
        phases["after faults"] = window_stats(outcomes, last_end, end_s).as_dict()
    whole = window_stats(outcomes, 0.0, end_s)
    phases["whole drill"] = whole.as_dict()
    before = _steady(journal.get("steady_states", {}).get("before"), drill.config)
    after = _steady(journal.get("steady_states", {}).get("after"), drill.config)
    verdict, text = _verdict(drill, journal, before, after)
    slo = float(drill.config["slo_success_pct"])
    activities = [
        {
            "name": run.get("activity", {}).get("name"),
            "type": run.get("activity", {}).get("type"),
            "status": run.get("status"),
            "output": run.get("output"),
        }
        for section in ("run", "rollbacks")
        for run in journal.get(section, [])
    ]
    return {
        "drill": drill.experiment_title or drill.name,
        "started": drill.started_at.isoformat(timespec="seconds"),
        "spec": str(drill.spec_path),
        "config": {k: v for k, v in drill.config.items() if k != "out_dir"},
        "verdict": verdict,
        "verdict_text": text,
        "chaostoolkit_status": journal.get("status"),
        "deviated": bool(journal.get("deviated")),
        "steady_state": {"before": before, "after": after},
        "numbers": {
            "sent": whole.sent,
            "answered": whole.ok,
            "failed": whole.failed,
            "degraded": whole.degraded,
            "success_pct": whole.as_dict()["success_pct"],
            "failures_by_code": whole.codes,
            **recovery(outcomes, spans, end_s, slo, baseline.zones),
        },
        "phases": phases,
        "windows": [
            {
                "label": w.label,
                "start_s": w.start_s,
                "end_s": w.end_s,
                **window_stats(outcomes, w.start_s, w.end_s or end_s).as_dict(),
            }
            for w in drill.windows
        ],
        "guard": {
            "min_success_pct": drill.guard.min_success_pct,
            "for_s": drill.guard.for_s,
            "max_p99_ms": drill.guard.max_p99_ms or None,
            "tripped": drill.guard.tripped,
            "reason": drill.guard.reason,
            "at_s": drill.guard.at_s,
        },
        "envoy": envoy_deltas(drill.counters_start, drill.counters_end),
        "marks": [{"at_s": m.at_s, "label": m.label, "kind": m.kind} for m in drill.marks],
        "activities": activities,
        "load_error": drill.load.error if drill.load is not None else "",
        "network": {"mode": "loopback"}
        if drill.network is None
        else {
            "mode": "netns",
            "namespaces": drill.network.namespaces,
            "nat_chains": drill.network.nat_chains,
            "addresses": {z: drill.network.address(z) for z in drill.network.zones},
        },
    }


# --- the picture -------------------------------------------------------------------------------


def plot_timeline(drill: Drill, summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outcomes = drill.outcomes_final
    # Whole buckets only: a last, partial second would read as a drop in traffic.
    end_s = max(BUCKET_S, math.floor(max((o.sent_s for o in outcomes), default=1.0)))
    series = buckets(outcomes, end_s)
    t = [s.start_s + BUCKET_S / 2 for s in series]
    zones = list(drill.spec.zones) if drill.mesh is not None else []
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    fig.suptitle(f"{summary['drill']} — {summary['verdict'].upper()}", fontsize=12)

    success = [s.success_pct if s.sent else math.nan for s in series]
    degraded = [(s.degraded_pct if s.ok else 0.0) if s.sent else math.nan for s in series]
    ax1.plot(t, success, color="tab:green", label="answered %")
    ax1.plot(t, degraded, color="tab:orange", label="degraded %", linestyle="--")
    ax1.axhline(float(drill.config["slo_success_pct"]), color="grey", linewidth=0.8, linestyle=":")
    low = min([v for v in success if not math.isnan(v)] + [90.0])
    ax1.set_ylim(max(0.0, low - 5), 101)
    ax1.set_ylabel("% of calls")

    ax2.plot(t, [s.p99_ms for s in series], color="tab:red", label="p99")
    ax2.plot(t, [s.p50_ms for s in series], color="tab:blue", label="p50")
    ax2.set_ylabel("latency (ms)")
    ax2.set_yscale("log")

    bottom = [0.0] * len(series)
    zone_colors = ["tab:blue", "tab:green", "tab:cyan", "tab:olive"]
    for index, zone in enumerate(zones):
        per_s = [
            sum(
                1
                for o in outcomes
                if s.start_s <= o.sent_s < s.end_s and o.zone == zone and o.code == "OK"
            )
            / BUCKET_S
            for s in series
        ]
        ax3.fill_between(
            t,
            bottom,
            [b + v for b, v in zip(bottom, per_s, strict=True)],
            label=zone,
            alpha=0.6,
            step="mid",
            color=zone_colors[index % len(zone_colors)],
        )
        bottom = [b + v for b, v in zip(bottom, per_s, strict=True)]
    fallback = [s.degraded / BUCKET_S for s in series]
    failed = [s.failed / BUCKET_S for s in series]
    ax3.plot(t, fallback, color="tab:orange", label="degraded", linestyle="--")
    ax3.plot(t, failed, color="black", label="failed", linestyle=":")
    ax3.set_ylabel("answers / s")
    ax3.set_xlabel("seconds since the load started")

    colors = ["tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]
    for i, window in enumerate(drill.windows):
        stop = window.end_s if window.end_s is not None else end_s
        for ax in (ax1, ax2, ax3):
            ax.axvspan(
                window.start_s,
                stop,
                color=colors[i % len(colors)],
                alpha=0.12,
                label=window.label if ax is ax1 else None,
            )
    for mark in drill.marks:
        if mark.kind == "guard":
            for ax in (ax1, ax2, ax3):
                ax.axvline(
                    mark.at_s,
                    color="red",
                    linewidth=1.2,
                    label="guard abort" if ax is ax1 else None,
                )
        elif mark.label in ("method", "rollbacks"):
            for ax in (ax1, ax2, ax3):
                ax.axvline(mark.at_s, color="grey", linewidth=0.6, linestyle="--")
    for ax in (ax1, ax2, ax3):
        ax.legend(loc="lower left", fontsize=7, ncol=3)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the words ---------------------------------------------------------------------------------


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


def markdown(summary: dict[str, Any]) -> str:
    n = summary["numbers"]
    config, guard = summary["config"], summary["guard"]
    recover = n["time_to_recover_s"]
    recover_text = _fmt(recover, " s") if recover is not None else "not recovered by the end"
    back = n["zones_back_s"]
    back_text = _fmt(back, " s after the faults") if back is not None else "not by the end"
    lines = [
        f"# Drill: {summary['drill']}",
        "",
        f"**Verdict: {summary['verdict'].upper()}** — {summary['verdict_text']}.",
        "",
        f"Started {summary['started']}; mesh spec `{summary['spec']}`; load "
        f"{config['rate']:g} calls/s (open loop, {config['load_timeout_s']:g} s "
        f"deadline); guard: abort below {guard['min_success_pct']:g}% success over "
        f"{guard['for_s']:g} s.",
        "",
        "![success rate, latency and traffic per zone; fault windows shaded](timeline.png)",
        "",
        "## The numbers",
        "",
        f"- requests sent: **{n['sent']}**, answered {n['answered']}, failed **{n['failed']}**"
        + (
            f" ({', '.join(f'{c} {k}' for c, k in n['failures_by_code'].items())})"
            if n["failures_by_code"]
            else ""
        )
        + f", degraded (fallback) answers **{n['degraded']}**",
        f"- success over the whole drill: **{_fmt(n['success_pct'], '%')}**",
        f"- seconds below the SLO ({summary['config']['slo_success_pct']:g}% answered, real "
        f"answers): {_fmt(n['slo_breach_s'])}",
        "- time to recover (from the end of the faults until the SLO held for good): "
        f"**{recover_text}**",
        f"- traffic back in every zone: {back_text}",
        "",
        "| | " + " | ".join(summary["phases"]) + " |",
        "| --- | " + " | ".join("---" for _ in summary["phases"]) + " |",
    ]
    rows = [
        ("sent", lambda p: str(p["sent"])),
        ("failed", lambda p: str(p["failed"])),
        ("degraded", lambda p: str(p["degraded"])),
        ("success", lambda p: _fmt(p["success_pct"], "%")),
        ("p50 / p99", lambda p: f"{_fmt(p['p50_ms'])} / {_fmt(p['p99_ms'])} ms"),
        ("served by zone", lambda p: _shares(p["zones"])),
        ("answered by version", lambda p: _shares(p["versions"])),
    ]
    for label, cell in rows:
        lines.append(
            f"| {label} | " + " | ".join(cell(p) for p in summary["phases"].values()) + " |"
        )
    lines += ["", "## Steady state (the SLO)", ""]
    before = summary["steady_state"]["before"] or {"probes": [], "met": None}
    after = summary["steady_state"]["after"] or {"probes": [], "met": None}
    after_by_name = {p["name"]: p for p in after["probes"]}
    lines += ["| probe | tolerance | before | after |", "| --- | --- | --- | --- |"]
    for probe in before["probes"]:
        later = after_by_name.get(probe["name"])
        cell_after = (
            "not checked" if later is None else f"{later['value']} {'✓' if later['met'] else '✗'}"
        )
        lines.append(
            f"| {probe['name']} | {probe['tolerance']} | {probe['value']} "
            f"{'✓' if probe['met'] else '✗'} | {cell_after} |"
        )
    lines += [
        "",
        "## Fault windows",
        "",
        "| fault | from (s) | to (s) | sent | success | p99 (ms) | served by zone |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in summary["windows"]:
        label = w["label"].replace("|", "/")
        lines.append(
            f"| {label} | {w['start_s']:.1f} | {_fmt(w['end_s'])} | {w['sent']} | "
            f"{_fmt(w['success_pct'], '%')} | {_fmt(w['p99_ms'])} | {_shares(w['zones'])} |"
        )
    env = summary["envoy"]
    lines += [
        "",
        "## Envoy (since the drill started)",
        "",
        f"- retries: {_shares_counts(env['retries'])}",
        f"- outlier ejections: {_shares_counts(env['ejections'])}",
        f"- overflows (circuit breakers, retry budget): {_shares_counts(env['overflows'])}",
        "",
        "## What happened, in order",
        "",
        "| t (s) | what |",
        "| --- | --- |",
    ]
    for mark in summary["marks"]:
        lines.append(f"| {mark['at_s']:.1f} | {mark['label']} |")
    failed = [a for a in summary["activities"] if a["status"] not in ("succeeded", None)]
    if failed:
        lines += ["", "Activities that failed: " + ", ".join(f"`{a['name']}`" for a in failed)]
    if summary.get("load_error"):
        lines += ["", f"The load generator failed: {summary['load_error']}"]
    lines += [
        "",
        "## Files",
        "",
        "- `journal.json`: the Chaos Toolkit journal (with this summary under `servemesh`)",
        "- `summary.json`: these numbers as data; `timeline.png`: the picture above",
        "- `mesh/logs/`: every process's log (JSON lines), Envoy's access logs",
        "",
    ]
    return "\n".join(lines)


def _shares_counts(counts: dict[str, int]) -> str:
    shown = {k: v for k, v in counts.items() if v}
    return ", ".join(f"{k} {v}" for k, v in sorted(shown.items())) or "none"


def write_report(drill: Drill, summary: dict[str, Any], journal: dict[str, Any]) -> dict[str, str]:
    out = drill.out_dir
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "report": str(out / "report.md"),
        "timeline": str(out / "timeline.png"),
        "summary": str(out / "summary.json"),
        "journal": str(out / "journal.json"),
    }
    plot_timeline(drill, summary, Path(files["timeline"]))
    Path(files["report"]).write_text(markdown(summary))
    Path(files["summary"]).write_text(json.dumps(summary, indent=2, default=str))
    Path(files["journal"]).write_text(
        json.dumps({**journal, "servemesh": {**summary, "files": files}}, indent=2, default=str)
    )
    return files
