"""A drill's report on disk: report.md, timeline.png, summary.json and journal.json in the
drill's folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servemesh.chaos.report.markdown import markdown
from servemesh.chaos.report.numbers import DrillSummary, timeline
from servemesh.chaos.report.plot import plot_timeline

if TYPE_CHECKING:
    from servemesh.chaos.drill import Drill


def write_report(drill: Drill, summary: DrillSummary, journal: dict[str, Any]) -> dict[str, str]:
    """Write the four files; returns their paths by kind (report, timeline, summary,
    journal). The journal gets the summary, with these paths, under `servemesh`."""
    out = drill.out_dir
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "report": str(out / "report.md"),
        "timeline": str(out / "timeline.png"),
        "summary": str(out / "summary.json"),
        "journal": str(out / "journal.json"),
    }
    zones = list(drill.spec.zones) if drill.mesh is not None or drill.compose else []
    windows = [(w.label, w.start_s, w.end_s) for w in drill.windows]
    plot_timeline(timeline(summary, drill.outcomes_final, zones, windows), Path(files["timeline"]))
    Path(files["report"]).write_text(markdown(summary))
    data = summary.as_dict()
    Path(files["summary"]).write_text(json.dumps(data, indent=2, default=str))
    Path(files["journal"]).write_text(
        json.dumps({**journal, "servemesh": {**data, "files": files}}, indent=2, default=str)
    )
    return files
