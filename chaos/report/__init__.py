"""A drill's verdict, numbers and report.

numbers   summarize(): the drill and its journal -> DrillSummary (typed; as_dict() is
          summary.json); recovery and Envoy counter deltas
plot      the timeline picture (timeline.png)
markdown  the words (report.md)
files     write_report(): the four files in the drill's folder
"""

from servemesh.chaos.report.files import write_report
from servemesh.chaos.report.markdown import markdown
from servemesh.chaos.report.numbers import (
    DrillSummary,
    Recovery,
    drill_recovery,
    envoy_deltas,
    recovery,
    summarize,
    timeline,
)
from servemesh.chaos.report.plot import plot_timeline

__all__ = [
    "DrillSummary",
    "Recovery",
    "drill_recovery",
    "envoy_deltas",
    "markdown",
    "plot_timeline",
    "recovery",
    "summarize",
    "timeline",
    "write_report",
]
