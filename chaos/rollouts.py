"""Rollouts in a drill: `servemesh rollout` run as operators run it, a process of its own
against the drill's mesh, so a drill can watch its automated decisions and kill it.

Each command is started through the drill's command supervisor (chaos/leftovers.py), logs
to `<run>/rollouts/<name>.log`, and is stopped by PID when the drill ends, whatever the
drill's outcome.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import yaml

from servemesh.chaos.drill import Drill
from servemesh.chaos.errors import DrillError
from servemesh.procs.supervisor import Child
from servemesh.state.rollouts import RolloutState, StateStore

_WORDS = {0: "promoted", 3: "rolled back", 4: "refused", 1: "failed"}


def _logs(drill: Drill) -> Path:
    return drill.out_dir / "rollouts"


def write_plan(drill: Drill, name: str, plan: dict[str, Any]) -> Path:
    """The plan a drill's rollout follows, as a file beside its log."""
    path = _logs(drill) / f"{name}-plan.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def command(drill: Drill, name: str, *args: str) -> Child:
    """Start `servemesh rollout ARGS` against the drill's mesh (not waiting for it)."""
    mesh = drill.running_mesh
    argv = [sys.executable, "-m", "servemesh", "rollout", "--state-dir", str(mesh.state_dir)]
    supervisor = drill.leftovers.commands(_logs(drill))
    if supervisor.is_running(name):
        raise DrillError(f"a rollout command named {name} is already running")
    return supervisor.start(name, [*argv, *args])


def finished(drill: Drill, child: Child, timeout_s: float) -> dict[str, Any]:
    """Wait for a rollout command to end; its exit status, outcome and last line (the
    reason, by the command's contract)."""
    began = time.monotonic()
    try:
        code = child.wait(timeout_s)
    except Exception:
        drill.leftovers.commands(_logs(drill)).kill(child.name)
        raise DrillError(f"{child.name} did not end within {timeout_s:.0f} s") from None
    lines = [line for line in child.log_tail(200).splitlines() if line.strip()]
    return {
        "exit": code,
        "outcome": _WORDS.get(code, f"exit {code}"),
        "reason": lines[-1] if lines else "",
        "waited_s": round(time.monotonic() - began, 3),
        "log": str(child.launch.log_path),
    }


def state(drill: Drill, model: str) -> RolloutState | None:
    return StateStore(drill.running_mesh.state_dir).load(model)


def wait_for_step(
    drill: Drill, model: str, version: str, step: str, child: Child, timeout_s: float
) -> RolloutState:
    """Wait until Envoy serves step `step` (e.g. "50%") of the rollout of `version`, or
    fail naming where it stands (or how its controller ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = state(drill, model)
        if (
            current is not None
            and current.version == version
            and current.step_label == step
            and current.step_applied
        ):
            return current
        if not child.alive():
            raise DrillError(
                f"the rollout of {model} {version} ended (exit {child.returncode}) before "
                f"step {step}: {child.log_tail(3)}"
            )
        if time.monotonic() > deadline:
            where = current.step_label if current is not None else "nothing recorded"
            raise DrillError(f"step {step} of {model} {version} not reached; at: {where}")
        if drill.abort.wait(0.1):
            raise DrillError("the guard aborted the drill")
