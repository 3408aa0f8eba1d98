"""The drill's picture: success rate, latency and answers per zone over time, each fault
window shaded, the guard's abort and the phase changes drawn as lines."""

from __future__ import annotations

import math
from pathlib import Path

from servemesh.chaos.report.numbers import Timeline

ZONE_COLORS = ["tab:blue", "tab:green", "tab:cyan", "tab:olive"]
WINDOW_COLORS = ["tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]


def plot_timeline(timeline: Timeline, path: Path) -> None:
    """Draw `timeline` as a PNG at `path` (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = timeline.t
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    fig.suptitle(timeline.title, fontsize=12)

    success = timeline.success_pct
    ax1.plot(t, success, color="tab:green", label="answered %")
    ax1.plot(t, timeline.degraded_pct, color="tab:orange", label="degraded %", linestyle="--")
    ax1.axhline(timeline.slo_pct, color="grey", linewidth=0.8, linestyle=":")
    low = min([v for v in success if not math.isnan(v)] + [90.0])
    ax1.set_ylim(max(0.0, low - 5), 101)
    ax1.set_ylabel("% of calls")

    ax2.plot(t, timeline.p99_ms, color="tab:red", label="p99")
    ax2.plot(t, timeline.p50_ms, color="tab:blue", label="p50")
    ax2.set_ylabel("latency (ms)")
    ax2.set_yscale("log")

    bottom = [0.0] * len(t)
    for index, (zone, per_s) in enumerate(timeline.zone_answers_per_s.items()):
        top = [b + v for b, v in zip(bottom, per_s, strict=True)]
        ax3.fill_between(
            t,
            bottom,
            top,
            label=zone,
            alpha=0.6,
            step="mid",
            color=ZONE_COLORS[index % len(ZONE_COLORS)],
        )
        bottom = top
    ax3.plot(t, timeline.degraded_per_s, color="tab:orange", label="degraded", linestyle="--")
    ax3.plot(t, timeline.failed_per_s, color="black", label="failed", linestyle=":")
    ax3.set_ylabel("answers / s")
    ax3.set_xlabel("seconds since the load started")

    axes = (ax1, ax2, ax3)
    for i, shade in enumerate(timeline.shades):
        for ax in axes:
            ax.axvspan(
                shade.start_s,
                shade.end_s,
                color=WINDOW_COLORS[i % len(WINDOW_COLORS)],
                alpha=0.12,
                label=shade.label if ax is ax1 else None,
            )
    for mark in timeline.marks:
        if mark.kind == "guard":
            for ax in axes:
                ax.axvline(
                    mark.at_s,
                    color="red",
                    linewidth=1.2,
                    label="guard abort" if ax is ax1 else None,
                )
        elif mark.label in ("method", "rollbacks"):
            for ax in axes:
                ax.axvline(mark.at_s, color="grey", linewidth=0.6, linestyle="--")
    for ax in axes:
        ax.legend(loc="lower left", fontsize=7, ncol=3)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
