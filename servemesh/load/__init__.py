"""Load generation and its numbers, for every load in servemesh: `servemesh bench predict`,
`servemesh bench model`, the tests that load a mesh, and the drills' background load.

    schedule    when requests leave: FixedRate / SendTimes (open loop), ClosedLoop
    target      what they go to: predict_target (gateway Predict), features_target
                (GetFeatures, as a gateway reads), raw_target (bytes)
    outcome     the one record per request (Outcome) and the function that times it
    drive       open_loop / closed_loop: run a schedule against a target -> LoadRun
    background  BackgroundLoad: an open loop in a thread until stopped, readable meanwhile
    stats       the one percentile (nearest rank), windows, success, shares, summaries

Open-loop latency is measured from each request's scheduled send time, so a stalled client
or server shows up as latency rather than as a lower rate (no coordinated omission); each
outcome also records how late its request actually left (`lag_ms`).
"""

from servemesh.load.background import BackgroundLoad
from servemesh.load.drive import closed_loop, open_loop
from servemesh.load.outcome import CLIENT_OVERLOADED, OK, Outcome, Reply, Request, timed
from servemesh.load.run import Event, EventRecord, LoadRun
from servemesh.load.schedule import ClosedLoop, FixedRate, OpenSchedule, SendTimes
from servemesh.load.stats import (
    Summary,
    WindowStats,
    percentile,
    share,
    success_ratio,
    summarize,
    window,
    window_stats,
)
from servemesh.load.target import Target, features_target, predict_target, raw_target

__all__ = [
    "CLIENT_OVERLOADED",
    "OK",
    "BackgroundLoad",
    "ClosedLoop",
    "Event",
    "EventRecord",
    "FixedRate",
    "LoadRun",
    "OpenSchedule",
    "Outcome",
    "Reply",
    "Request",
    "SendTimes",
    "Summary",
    "Target",
    "WindowStats",
    "closed_loop",
    "open_loop",
    "percentile",
    "predict_target",
    "features_target",
    "raw_target",
    "share",
    "success_ratio",
    "summarize",
    "timed",
    "window",
    "window_stats",
]
