"""The quarantine decision: which versions the crashes keep naming, and where their traffic
goes. Pure functions and a clock of the test's own; the route change is a recorder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servemesh.quarantine import (
    Quarantine,
    QuarantineState,
    crash_record,
    crashes_of,
    due_versions,
    exit_text,
    last_good_version,
    quarantined_weights,
    read_crashes,
    release,
)
from servemesh.spec import MeshSpec, QuarantineSpec


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def batch(model: str, version: str, *request_ids: str) -> dict[str, Any]:
    calls = [{"request_id": r, "caller": "peer", "sha256": "00" * 32} for r in request_ids]
    return {"model": model, "version": version, "calls": calls}


def record(when: float, *batches: dict[str, Any]) -> dict[str, Any]:
    return crash_record(when, "model-risk-zone-a-0", "risk", -11, batches)


POLICY = QuarantineSpec(crashes=3, within="5m")


def test_n_crashes_within_the_window_make_a_version_due() -> None:
    t = 1000.0
    crashes = [record(t, batch("risk", "v2", "a")), record(t + 60, batch("risk", "v2", "b"))]
    assert due_versions(crashes, POLICY, t + 61) == []
    crashes.append(record(t + 120, batch("risk", "v2", "c"), batch("risk", "v1", "d")))
    assert due_versions(crashes, POLICY, t + 121) == [("risk", "v2")]  # v1: one crash
    # The first crash leaves the window 5 minutes after it: two are not enough.
    assert due_versions(crashes, POLICY, t + 301) == []


def test_a_crash_counts_once_however_many_of_a_versions_calls_it_held() -> None:
    crashes = [record(1000.0, batch("risk", "v2", "a", "b", "c"))]
    assert due_versions(crashes, POLICY, 1001.0) == []


def test_quarantined_versions_and_crashes_before_a_release_do_not_count() -> None:
    crashes = [record(1000.0 + i, batch("risk", "v2", f"r{i}")) for i in range(3)]
    assert due_versions(crashes, POLICY, 1010.0, quarantined=[("risk", "v2")]) == []
    released = {("risk", "v2"): 1002.0}
    assert due_versions(crashes, POLICY, 1010.0, released=released) == []
    crashes += [record(1003.0 + i, batch("risk", "v2", f"s{i}")) for i in range(3)]
    assert due_versions(crashes, POLICY, 1010.0, released=released) == [("risk", "v2")]


def test_an_off_policy_decides_nothing() -> None:
    crashes = [record(1000.0 + i, batch("risk", "v2", f"r{i}")) for i in range(5)]
    assert due_versions(crashes, QuarantineSpec(enabled=False), 1010.0) == []


def test_the_share_goes_to_the_highest_good_version_with_traffic() -> None:
    traffic = {"v1": 20, "v2": 30, "v3": 50, "v10": 0}
    assert last_good_version(traffic, "v3", [], "risk") == "v2"
    assert last_good_version(traffic, "v3", [("risk", "v2")], "risk") == "v1"
    assert last_good_version(traffic, "v3", [("other", "v2")], "risk") == "v2"
    assert last_good_version({"v1": 0, "v2": 100}, "v2", [], "risk") is None
    assert last_good_version({"v9": 50, "v10": 50, "v11": 0}, "v11", [], "m") == "v10"
    assert quarantined_weights(traffic, "v3", "v2") == {"v1": 20, "v2": 80, "v3": 0, "v10": 0}


def test_the_spec_setting_is_typed_and_strict() -> None:
    spec = MeshSpec.model_validate({"sandbox": {"quarantine": {"crashes": 2, "within": "90s"}}})
    assert spec.sandbox.quarantine == QuarantineSpec(crashes=2, within="90s")
    assert MeshSpec().sandbox.quarantine == QuarantineSpec(enabled=True, crashes=3, within="5m")
    with pytest.raises(ValueError):
        MeshSpec.model_validate({"sandbox": {"quarantine": {"within": "five minutes"}}})
    with pytest.raises(ValueError):
        MeshSpec.model_validate({"sandbox": {"quarantine": {"crashes": 0}}})
    with pytest.raises(ValueError):
        MeshSpec.model_validate({"sandbox": {"quarantine": {"after": 3}}})


def test_the_launchers_side_records_then_quarantines_once(tmp_path: Path) -> None:
    clock = Clock()
    moved: list[tuple[str, str, str]] = []

    def move(model: str, version: str, reason: str) -> str | None:
        moved.append((model, version, reason))
        return "v1"

    quarantine = Quarantine(tmp_path, QuarantineSpec(crashes=2, within="5m"), move, clock)
    assert (
        quarantine.record_crash("model-risk-zone-a-0", "risk", -11, [batch("risk", "v2", "a")])
        == []
    )
    clock.now += 30
    due = quarantine.record_crash("model-risk-zone-b-0", "risk", 1, [batch("risk", "v2", "b")])
    assert due == [("risk", "v2")]
    assert quarantine.quarantine("risk", "v2")
    assert moved and "quarantine" in moved[0][2] and "2 model server crashes" in moved[0][2]
    state = QuarantineState.read(tmp_path)
    assert state.quarantined[("risk", "v2")]["traffic_to"] == "v1"
    # Quarantined: a further crash does not ask again.
    clock.now += 1
    assert (
        quarantine.record_crash("model-risk-zone-a-0", "risk", -6, [batch("risk", "v2", "c")]) == []
    )
    records = read_crashes(tmp_path)
    assert [r["exit_text"] for r in records] == ["SIGSEGV", "exit 1", "SIGABRT"]
    assert [c["request_id"] for r in crashes_of(records, "risk", "v2") for c in r["inflight"]] == [
        "a",
        "b",
        "c",
    ]
    # Released: listed no more, and the crashes it was released with count no more.
    clock.now += 1
    assert release(tmp_path, "risk", "v2", clock)["traffic_to"] == "v1"
    assert QuarantineState.read(tmp_path).quarantined == {}
    with pytest.raises(KeyError):
        release(tmp_path, "risk", "v2", clock)
    clock.now += 1
    assert (
        quarantine.record_crash("model-risk-zone-a-0", "risk", -11, [batch("risk", "v2", "d")])
        == []
    )
    assert (tmp_path / "crashes.jsonl").stat().st_mode & 0o077 == 0


def test_exit_texts() -> None:
    assert (
        exit_text(-9) == "SIGKILL" and exit_text(3) == "exit 3" and exit_text(-200) == "signal 200"
    )
