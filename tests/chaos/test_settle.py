"""The settle step after a drill's baseline, without a mesh: it waits until the load's last
window looks steady (every call answered for real, every zone serving), at most settle_s,
and says on the timeline how long it waited."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from servemesh.chaos.drill import Drill
from servemesh.load import Outcome, window_stats
from servemesh.load.stats import WindowStats


def answers(zones: dict[str, int], **kw: Any) -> WindowStats:
    outcomes = [
        Outcome(0.0, 5.0, "OK", zone=zone, version="v1", **kw)
        for zone, count in zones.items()
        for _ in range(count)
    ]
    return window_stats(outcomes, 0.0, 1.0)


BALANCED = answers({"zone-a": 50, "zone-b": 50})
ONE_ZONE_EJECTED = answers({"zone-a": 98, "zone-b": 2})


class Load:
    """The drill's load as the settle step reads it: its clock and its last window, one
    window per look, the last one kept."""

    def __init__(self, windows: list[WindowStats]) -> None:
        self.windows = windows
        self.looks = 0
        self.t = 10.0

    def now_s(self) -> float:
        return self.t

    def last(self, seconds: float) -> WindowStats:
        window = self.windows[min(self.looks, len(self.windows) - 1)]
        self.looks += 1
        return window


def a_drill(tmp_path: Path, windows: list[WindowStats], settle_s: float = 20.0) -> Drill:
    drill = Drill("settle test", {"out_dir": str(tmp_path), "settle_s": settle_s})
    load = Load(windows)
    drill.load = cast(Any, load)
    drill.mesh = cast(Any, SimpleNamespace(spec=SimpleNamespace(zones=["zone-a", "zone-b"])))

    def sleep(seconds: float) -> bool:  # the drill's clock moves as it waits
        load.t += seconds
        return True

    drill.sleep = sleep  # type: ignore[method-assign]
    return drill


def labels(drill: Drill) -> list[str]:
    return [m.label for m in drill.timeline.marks]


def test_a_settled_mesh_is_judged_at_once(tmp_path: Path) -> None:
    drill = a_drill(tmp_path, [BALANCED])
    drill._settle()
    assert labels(drill) == [] and cast(Load, drill.load).t == 10.0


def test_an_ejected_zone_is_waited_for_until_it_serves_again(tmp_path: Path) -> None:
    drill = a_drill(tmp_path, [ONE_ZONE_EJECTED] * 4 + [BALANCED])
    drill._settle()
    assert labels(drill) == ["settled after 2.0 s more"]


def test_failures_and_fallbacks_are_not_settled(tmp_path: Path) -> None:
    failing = window_stats([Outcome(0.0, 5.0, "UNAVAILABLE")], 0.0, 1.0)
    fallbacks = answers({"zone-a": 50, "zone-b": 50}, degraded=True)
    drill = a_drill(tmp_path, [failing, fallbacks, BALANCED])
    drill._settle()
    assert labels(drill) == ["settled after 1.0 s more"]


def test_a_mesh_that_never_settles_is_judged_after_settle_s(tmp_path: Path) -> None:
    drill = a_drill(tmp_path, [ONE_ZONE_EJECTED], settle_s=3.0)
    drill._settle()
    assert labels(drill) == ["not settled after 3.0 s"]
    assert cast(Load, drill.load).t == 13.0


def test_settle_s_zero_judges_right_after_the_baseline(tmp_path: Path) -> None:
    drill = a_drill(tmp_path, [ONE_ZONE_EJECTED], settle_s=0.0)
    drill._settle()
    assert labels(drill) == ["not settled after 0.0 s"]
