"""What `servemesh chaos run` prints as a drill goes: the line each runbook tells an
operator to look for is on the console, not only in a log under the run's folder (a
rollout's reason for rolling back, each steady-state probe that did not hold)."""

from __future__ import annotations

from rich.console import Console

from servemesh.chaos.runner import _Progress

REASON = (
    "rolled back: step 10%: error_ratio fail: error ratio 27.66% vs baseline 0.00% "
    "(n=47 vs 412) [limit 5%]"
)


def _console() -> Console:
    return Console(width=200, record=True, color_system=None)


def test_a_rolled_back_rollout_prints_its_reason_under_the_activity() -> None:
    console = _console()
    progress = _Progress(console)
    outcome = {"exit": 3, "outcome": "rolled back", "reason": REASON, "waited_s": 4.2}
    progress.activity_completed(
        {"type": "action", "name": "roll-out-the-canary"},
        {"status": "succeeded", "output": outcome},
    )
    lines = console.export_text().splitlines()
    assert lines[0].endswith("ok roll-out-the-canary")
    # Whole, markup and all ([limit 5%] is text, not a style).
    assert lines[1].endswith(f"    {REASON}")


def test_other_outputs_print_as_before() -> None:
    console = _console()
    progress = _Progress(console)
    progress.activity_completed({"name": "share-pct"}, {"status": "succeeded", "output": 7.5})
    progress.activity_completed({"name": "a-window"}, {"status": "succeeded", "output": {"n": 1}})
    lines = console.export_text().splitlines()
    assert [line.split("s   ", 1)[1] for line in lines] == ["ok share-pct -> 7.5", "ok a-window"]


def test_a_steady_state_not_met_names_each_probe_that_missed() -> None:
    console = _console()
    progress = _Progress(console)
    state = {
        "steady_state_met": False,
        "probes": [
            {
                "activity": {"name": "answered-last-window-pct", "tolerance": [99.5, 100]},
                "status": "succeeded",
                "output": 97.25,
                "tolerance_met": False,
            },
            {
                "activity": {"name": "fallback-answers-last-window-pct", "tolerance": [0, 0.5]},
                "status": "succeeded",
                "output": 0.0,
                "tolerance_met": True,
            },
        ],
    }
    progress.hypothesis_after_completed({}, state, {})
    text = console.export_text()
    assert "steady state after: NOT met" in text
    assert "answered-last-window-pct: 97.25, allowed [99.5, 100]" in text
    assert "fallback-answers-last-window-pct" not in text
