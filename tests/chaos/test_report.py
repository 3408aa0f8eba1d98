"""A drill's report without a mesh: its numbers come from servemesh.load's statistics, and
its four files say the same thing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servemesh.chaos.drill import Drill, FaultWindow, Mark
from servemesh.chaos.report import markdown, summarize, write_report
from servemesh.load import Outcome, percentile


def a_finished_drill(out_dir: Path) -> tuple[Drill, dict[str, Any]]:
    """A drill as finish() leaves it: 20 s of calls at 50/s, all failing from 8 to 10 s."""
    drill = Drill("report test", {"out_dir": str(out_dir)})
    drill.outcomes_final = [
        Outcome(
            i / 50,
            1.0 + (i * 7) % 40,
            "UNAVAILABLE" if 8 <= i / 50 < 10 else "OK",
            version="v1",
            zone="zone-a" if i % 2 else "zone-b",
        )
        for i in range(1000)
    ]
    drill.windows = [FaultWindow("kill", "kill zone-a", 8.0, 10.0)]
    drill.marks = [
        Mark(5.0, "method", "phase"),
        Mark(8.0, "kill"),
        Mark(12.0, "rollbacks", "phase"),
    ]
    probe = {"activity": {"name": "success"}, "output": 100.0, "tolerance_met": True}
    journal = {
        "status": "completed",
        "steady_states": {
            "before": {"steady_state_met": True, "probes": [probe]},
            "after": {"steady_state_met": True, "probes": [probe]},
        },
    }
    return drill, journal


def test_the_report_reads_its_latencies_from_the_load_package(tmp_path: Path) -> None:
    drill, journal = a_finished_drill(tmp_path)
    try:
        summary = summarize(drill, journal)
    finally:
        drill.close()
    answered = [o.latency_ms for o in drill.outcomes_final if o.ok]
    whole = summary.phases["whole drill"]
    assert (whole.p50_ms, whole.p99_ms) == (percentile(answered, 50), percentile(answered, 99))
    assert summary.windows[0].stats.sent == 100 and summary.windows[0].stats.ok == 0
    assert summary.numbers.failed == 100 and summary.verdict == "held"
    text = markdown(summary)
    assert "**Verdict: HELD**" in text
    row = next(line for line in text.splitlines() if line.startswith("| p50 / p99 |"))
    assert row.endswith(f"| {whole.p50_ms:.1f} / {whole.p99_ms:.1f} ms |")  # the last column
    assert "| kill zone-a | 8.0 | 10.0 | 100 | 0.0% | — | — |" in text.splitlines()


def test_write_report_writes_the_four_files_from_one_summary(tmp_path: Path) -> None:
    drill, journal = a_finished_drill(tmp_path)
    try:
        summary = summarize(drill, journal)
        files = write_report(drill, summary, journal)
    finally:
        drill.close()
    assert set(files) == {"report", "timeline", "summary", "journal"}
    assert Path(files["report"]).read_text() == markdown(summary)
    assert Path(files["timeline"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(Path(files["summary"]).read_text())
    assert data == json.loads(json.dumps(summary.as_dict(), default=str))
    assert data["phases"]["whole drill"]["p99_ms"] == round(summary.phases["whole drill"].p99_ms, 3)
    saved = json.loads(Path(files["journal"]).read_text())
    assert saved["servemesh"]["files"] == files and saved["servemesh"]["verdict"] == "held"


def test_the_report_names_why_answers_were_fallbacks(tmp_path: Path) -> None:
    drill, journal = a_finished_drill(tmp_path)
    reason = "model service: no healthy upstream"
    drill.outcomes_final = [
        *drill.outcomes_final,
        *(Outcome(19.0, 2.0, "OK", degraded=True, degraded_reason=reason) for _ in range(3)),
    ]
    try:
        summary = summarize(drill, journal)
    finally:
        drill.close()
    assert summary.numbers.degraded == 3
    assert summary.numbers.fallbacks_by_reason == {reason: 3}
    assert summary.as_dict()["numbers"]["fallbacks_by_reason"] == {reason: 3}
    line = next(line for line in markdown(summary).splitlines() if "degraded (fallback)" in line)
    assert line.endswith(f"degraded (fallback) answers **3** (3 `{reason}`)")
