"""`servemesh down`: stop the mesh a state dir names, from any shell, as Ctrl-C in its
`servemesh up` would: SIGINT to the PID its state dir lock names (never a process found
by name), then wait until that mesh has stopped every process it started and let the
state dir go (servemesh/state/lock.py)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from servemesh.cli.flags import add_duration
from servemesh.cli.mesh import add_mesh_flags
from servemesh.cli.output import console, out
from servemesh.cli.status import held_mesh
from servemesh.contract.errors import ServemeshError
from servemesh.state.lock import Holder, live_holder, pid_alive

# A lock taken a moment ago may not name its holder yet (mesh_lock.MeshLock.take).
NAMED_WAIT_S = 2.0


def _named(holder: Holder, state_dir: Path) -> Holder:
    """The holder once its lock names it."""
    deadline = time.monotonic() + NAMED_WAIT_S
    while holder.pid <= 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        holder = live_holder(state_dir) or holder
    if holder.pid <= 0:
        raise ServemeshError(f"the mesh at {state_dir} has not named its process yet: try again")
    return holder


def exited(pid: int) -> bool:
    """Whether `pid` has exited: gone, or a zombie its parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return not pid_alive(pid)
    # The state follows the command's name in parentheses (which may hold spaces).
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def cmd_down(args: argparse.Namespace) -> int:
    state_dir, holder = held_mesh(args)
    holder = _named(holder, state_dir)
    if holder.pid == os.getpid():
        raise ServemeshError(f"the mesh at {state_dir} runs in this process: stop it here")
    try:
        os.kill(holder.pid, signal.SIGINT)
    except ProcessLookupError:
        pass  # exited between the lock's answer and the signal: what was asked
    except PermissionError as exc:
        raise ServemeshError(f"cannot signal pid {holder.pid}: {exc.strerror}") from None
    console.print(f"stopping the mesh at {state_dir} (pid {holder.pid})...", markup=False)
    # The lock goes once the mesh stopped every process it started (or with its holder).
    deadline = time.monotonic() + args.timeout
    while live_holder(state_dir) is not None:
        if time.monotonic() > deadline:
            raise ServemeshError(
                f"the mesh at {state_dir} (pid {holder.pid}) has not stopped after "
                f"{args.timeout:g} s; its processes' logs: {state_dir}/logs"
            )
        time.sleep(0.1)
    # Then `up` itself ends (it prints "stopped" after its mesh let the state dir go).
    while not exited(holder.pid):
        if time.monotonic() > deadline:
            raise ServemeshError(f"pid {holder.pid} stopped its mesh but has not exited")
        time.sleep(0.05)
    out.print(f"stopped the mesh at {state_dir} (pid {holder.pid})", highlight=False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    down = sub.add_parser(
        "down",
        help="stop the running mesh, as Ctrl-C in its `servemesh up` would, and wait for it",
    )
    add_mesh_flags(down)
    add_duration(
        down,
        "--timeout",
        "how long to wait for every process to stop (default 120s)",
        dest="timeout",
        default=120.0,
    )
    down.set_defaults(func=cmd_down)
