"""The operator's error tree: every refusal a `servemesh` command can meet is a
`ServemeshError`, and its class says the exit status the command ends with.

Exit statuses, kept by every command (docs/cli.md prints this table):

    0    ok
    1    refused, or bad input (the message names the field or flag)
    2    usage: a flag the command does not take, or a missing or contradictory one
    3    rolled back (a rollout that did not promote)
    4    refused by a gate (a rollout's checklist, a freeze, a rollout under way, a mesh
         already running from the state dir `up` was given)
    5    no running mesh to talk to (nothing runs from the state dir the command was given)
    130  interrupted (Ctrl-C)

The command line prints one line for any of them (`error: ...`, or `refused: ...` for a
change that was refused) and ends with the class's `exit_code`; nothing else turns an
exception into an exit status. Classes elsewhere subclass this one and keep the builtin
base their callers catch (`class ApplyError(ServemeshError, ValueError)`).
"""

from __future__ import annotations

from typing import Any

OK = 0
REFUSED = 1
USAGE = 2
ROLLED_BACK = 3
GATE_REFUSED = 4
NO_MESH = 5
INTERRUPTED = 130

EXIT_CODES: dict[int, str] = {
    OK: "ok",
    REFUSED: "refused, or bad input (the message names the field or flag)",
    USAGE: "usage: a flag the command does not take, or a missing or contradictory one",
    ROLLED_BACK: "rolled back: the rollout did not promote (the reason is printed last)",
    GATE_REFUSED: "refused by a gate: the checklist, a freeze, a rollout already under way, "
    "a mesh already running from the state dir (`up`)",
    NO_MESH: "no running mesh to talk to (start one with `servemesh up`, or point at one "
    "with --state-dir)",
    INTERRUPTED: "interrupted (Ctrl-C)",
}


class ServemeshError(Exception):
    """A refusal an operator reads as one line; `exit_code` is the command's status.

    A subclass sets `exit_code` (and `label`, the word before the message); one raise can
    give its own: `ServemeshError("...", exit_code=USAGE)`.
    """

    exit_code: int = REFUSED
    label: str = "error"

    def __init__(self, *args: Any, exit_code: int | None = None) -> None:
        super().__init__(*args)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(ServemeshError):
    """The command line itself is wrong (a missing or contradictory flag)."""

    exit_code = USAGE


class NoMesh(ServemeshError):
    """No mesh runs from the state dir a command was pointed at."""

    exit_code = NO_MESH

    def __init__(self, state_dir: object) -> None:
        super().__init__(
            f"no running mesh at {state_dir}: start one with `servemesh up`, or point at a "
            "running one with --state-dir DIR or SERVEMESH_STATE_DIR"
        )
        self.state_dir = state_dir


class RolledBack(ServemeshError):
    """A rollout ended rolled back."""

    exit_code = ROLLED_BACK


class GateRefused(ServemeshError):
    """A gate (checklist, freeze window, a rollout under way) refused to start."""

    exit_code = GATE_REFUSED
