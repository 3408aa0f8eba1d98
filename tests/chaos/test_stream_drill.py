"""The stream-consumer-crash drill against a real mesh: its consumer SIGKILLed mid-stream
under 500 events/s and restarted; every event has exactly one output, and the report
shows the lag's spike and recovery."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.test_drills import drill, method_output

pytestmark = pytest.mark.mesh


def test_a_killed_consumer_loses_and_repeats_no_event(tmp_path: Path) -> None:
    result = drill("stream-consumer-crash", tmp_path, baseline_s=3, stream_s=10, down_s=2)
    assert result.journal["status"] == "completed", result.text
    delivery = method_output(result, "delivery")
    assert delivery["sent"] == 5000
    assert delivery["missing"] == 0 and delivery["duplicated"] == 0, delivery
    assert method_output(result, "seconds-until-every-event-is-handled") >= 0
    lag = method_output(result, "lag-spike-and-recovery")
    assert lag["peak_backlog"] > lag["backlog_before_kill"], lag
    assert lag["recovery_s"] is not None, lag
    assert (result.out_dir / "stream-lag.md").stat().st_size > 0
    assert (result.out_dir / "stream-lag.png").stat().st_size > 0
