"""`servemesh rollout` as a command line, without a mesh: plan files, status of a recorded
rollout, errors that name what is wrong, the exit statuses."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from servemesh.cli import main
from servemesh.cli.rollout import load_plan
from servemesh.rollout.controller import ControllerError
from servemesh.state.rollouts import StateStore
from tests.rollout.fakes import Crash, World, controller, short_plan


def test_a_plan_file_is_read_and_its_errors_name_the_field(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("steps: [{weight: null, dwell: 1s}, {weight: 100}]\nanalysis: {interval: 2s}\n")
    plan = load_plan(str(good))
    assert [s.label for s in plan.steps] == ["shadow", "100%"]
    assert plan.analysis.interval_s == 2.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [{weight: 5}, {weight: 150}]\n")
    with pytest.raises(ControllerError, match=r"--plan .*bad.yaml: steps\.1\.weight: "):
        load_plan(str(bad))
    typo = tmp_path / "typo.yaml"
    typo.write_text("steps: [{weight: 100}]\nanalysys: {}\n")
    with pytest.raises(ControllerError, match="analysys: Extra inputs are not permitted"):
        load_plan(str(typo))
    with pytest.raises(ControllerError, match="cannot read"):
        load_plan(str(tmp_path / "missing.yaml"))


def test_status_shows_a_rollout_whose_controller_died(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world = World(t=time.time())

    def crash(w: World) -> None:
        if w.weights.get("v2") == 25:
            raise Crash()

    world.on_sleep.append(crash)
    with pytest.raises(Crash):
        controller(tmp_path, world).start("fraud", "v2", short_plan(None, 25, 100))
    assert main(["rollout", "--state-dir", str(tmp_path), "status", "fraud", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["status"], row["step"], row["controller_alive"]) == ("running", "25%", False)
    assert row["weights"] == {"v1": 75, "v2": 25}
    assert row["steps"] == ["shadow", "25%", "100%"]
    assert row["deadline_in_s"] is not None  # the fake clock is far from today's
    assert main(["rollout", "--state-dir", str(tmp_path), "status", "fraud"]) == 0
    text = capsys.readouterr().out
    assert "rollout of fraud: v1 -> v2" in text and "not running" in text
    assert "[25%]" in text
    # Past its deadline, with no controller: status tries to roll it back (here there is no
    # mesh to do it on), says so, and still shows what is recorded.
    StateStore(tmp_path).update(
        "fraud", lambda s: s.model_copy(update={"started_at": time.time() - 3600})
    )
    assert main(["rollout", "--state-dir", str(tmp_path), "status", "fraud", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == "running"
    assert "past its deadline, but the rollback failed: no running mesh" in captured.err


def test_commands_on_a_model_without_a_rollout_fail_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    controller(tmp_path, World()).start("fraud", "v2", short_plan(100))
    assert main(["rollout", "--state-dir", str(tmp_path), "status", "wine"]) == 1
    assert "no rollout of 'wine' has been recorded" in capsys.readouterr().err
    assert main(["rollout", "--state-dir", str(tmp_path), "pause", "wine"]) == 1
    assert "no rollout of 'wine'" in capsys.readouterr().err


def test_an_ended_rollout_cannot_be_paused_and_says_how_it_ended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    controller(tmp_path, World()).start("fraud", "v2", short_plan(100))
    assert main(["rollout", "--state-dir", str(tmp_path), "pause", "fraud"]) == 1
    assert "has ended: promoted" in capsys.readouterr().err
    events = StateStore(tmp_path).history("fraud")
    assert [e["event"] for e in events][-1] == "promoted"


def test_history_lists_overrides_with_their_reasons(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.rollout.fakes import Gates

    gates = Gates(failing={"freeze"})
    controller(tmp_path, World(), gates).start(
        "fraud", "v2", short_plan(100), overrides={"freeze": "INC-42 hotfix"}
    )
    assert main(["rollout", "--state-dir", str(tmp_path), "history", "fraud", "--json"]) == 0
    events = json.loads(capsys.readouterr().out)
    (override,) = [e for e in events if e["event"] == "override"]
    assert override["item"] == "freeze" and override["reason"] == "INC-42 hotfix"
