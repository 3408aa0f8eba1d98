"""Every command that talks to a running mesh, pointed at a state dir with none: exit
status 5 and the same one line, never a traceback or an empty answer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from servemesh.cli import main

# (command line, where the state dir goes: "after" the command's own name, "group" before
# its subcommand); FILE is a spec file that exists.
COMMANDS = [
    ["status"],
    ["down"],
    ["routes", "show"],
    ["routes", "set", "fraud", "v1=100"],
    ["routes", "history"],
    ["routes", "rollback"],
    ["routes", "shadow", "fraud", "v2"],
    ["routes", "shadow-report", "fraud"],
    ["apply", "FILE"],
    ["models", "list"],
    ["models", "show", "fraud", "v1"],
    ["models", "alias", "fraud", "production", "v1"],
    ["models", "push", "FILE", "--model", "fraud", "--version", "v9"],
    ["features", "load", "FILE", "--view", "customer", "--key", "id"],
    ["certs", "show"],
    ["certs", "rotate"],
    ["fleet", "show"],
    ["fleet", "retire"],
    ["fleet", "discard"],
    ["rollout", "start", "fraud", "v2"],
    ["rollout", "status"],
    ["rollout", "history"],
    ["rollout", "pause", "fraud"],
    ["rollout", "resume", "fraud"],
    ["rollout", "abort", "fraud", "--reason", "test"],
    ["rollout", "promote", "fraud"],
    ["trace", "--slowest", "1"],
    ["trace", "--hops", "10"],
    ["trace", "0123456789abcdef"],
    ["log", "query"],
    ["log", "status"],
    ["top", "--once"],
    ["load", "--duration", "1s"],
    ["predict", "--model", "fraud", "--entity", "user-1"],
]
GROUPS = {"routes", "models", "certs", "fleet", "rollout", "features"}


def _argv(command: list[str], state: Path, spec: Path, where: str) -> list[str]:
    argv = [str(spec) if word == "FILE" else word for word in command]
    flags = ["--state-dir", str(state)]
    if where == "group":
        return [argv[0], *flags, *argv[1:]]
    return [*argv, *flags]


def _line(state: Path) -> str:
    return (
        f"error: no running mesh at {state}: start one with `servemesh up`, or point at a "
        "running one with --state-dir DIR or SERVEMESH_STATE_DIR"
    )


# Every command with the flags after it; those of a group with subcommands also with the
# flags before the subcommand.
PLACES = [
    pytest.param(command, where, id=f"{' '.join(command)}-{where}")
    for command in COMMANDS
    for where in ("after", "group")
    if where == "after" or command[0] in GROUPS
]


@pytest.mark.parametrize(("command", "where"), PLACES)
def test_no_running_mesh_is_exit_5_and_one_line(
    command: list[str],
    where: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SERVEMESH_STATE_DIR", raising=False)
    state = tmp_path / "state"
    state.mkdir()
    spec = tmp_path / "mesh.yaml"
    spec.write_text("zones: [zone-a]\n")
    assert main(_argv(command, state, spec, where)) == 5
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [_line(state)]
    assert captured.out == ""


def test_routes_apply_says_where_it_went_then_the_same_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "mesh.yaml"
    spec.write_text("zones: [zone-a]\n")
    assert main(["routes", "apply", str(spec), "--state-dir", str(tmp_path)]) == 5
    note, line = capsys.readouterr().err.splitlines()
    assert "is now `servemesh apply" in note and line == _line(tmp_path)


def test_the_environment_names_the_state_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SERVEMESH_STATE_DIR", str(tmp_path))
    assert main(["fleet", "show"]) == 5
    assert capsys.readouterr().err.splitlines() == [_line(tmp_path)]


def test_top_once_as_a_process_prints_the_line_not_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "servemesh", "top", "--once", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr.splitlines(), done.stdout) == (5, [_line(tmp_path)], "")
