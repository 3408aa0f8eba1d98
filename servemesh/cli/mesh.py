"""How every command finds the mesh it talks to, and the flags that say where it is.

The state dir is `--state-dir`, else `SERVEMESH_STATE_DIR`, else the spec's (`--spec`, else
./mesh.yaml, else the built-in `.servemesh`). A mesh runs there when `servemesh up` has
written its resolved spec; when none does, every command answers with the same line and
exit status 5 (servemesh/contract/errors.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from servemesh.contract.errors import NoMesh
from servemesh.spec import load_spec
from servemesh.state.paths import MeshPaths, NoRunningMesh
from servemesh.state.running import RunningMesh

STATE_DIR_ENV = "SERVEMESH_STATE_DIR"
STATE_DIR_HELP = f"the running mesh's state dir (default: ${STATE_DIR_ENV}, else the spec's)"
SPEC_HELP = "the mesh spec naming the state dir (default: ./mesh.yaml, else built-in defaults)"


def add_mesh_flags(parser: argparse.ArgumentParser, *, inherited: bool = False) -> None:
    """`--state-dir` and `--spec` on a command. `inherited`: on a subcommand whose group
    takes them too (`servemesh models --state-dir D push` and `servemesh models push
    --state-dir D` both work); a flag left out there keeps the group's value."""
    default: Any = argparse.SUPPRESS if inherited else None
    parser.add_argument("--state-dir", default=default, help=STATE_DIR_HELP)
    parser.add_argument("--spec", default=default, help=SPEC_HELP)


def state_dir_of(args: argparse.Namespace) -> Path:
    """Where the mesh a command means keeps its state (a SpecError names a bad --spec)."""
    given = getattr(args, "state_dir", None) or os.environ.get(STATE_DIR_ENV)
    if given:
        return Path(given)
    return Path(load_spec(getattr(args, "spec", None)).state_dir)


def running_mesh(args: argparse.Namespace) -> RunningMesh:
    """The mesh the command's flags point at; NoMesh (exit 5) when none runs there."""
    state_dir = state_dir_of(args)
    try:
        return RunningMesh.at(state_dir)
    except NoRunningMesh:
        raise NoMesh(state_dir) from None


def recorded_state_dir(args: argparse.Namespace, *records: str) -> Path:
    """The state dir of a command that reads what a mesh recorded (its prediction log,
    traces, rollouts): a running mesh's, or a stopped one's that holds one of `records`
    (paths under it); NoMesh when it holds neither."""
    state_dir = state_dir_of(args)
    if MeshPaths(state_dir).resolved_spec.is_file():
        return state_dir
    if any((state_dir / record).exists() for record in records):
        return state_dir
    raise NoMesh(state_dir)
