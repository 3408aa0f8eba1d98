"""Forking children: a parent-death signal, a session of their own, one forking thread.

Every long-lived child of servemesh is forked here and nowhere else.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from servemesh.contract.private import PRIVATE_UMASK
from servemesh.procs.sandbox import RunAs, SandboxError

# setpriv's names for the signals a child may get when its parent dies.
_SIGNAL_NAMES = {signal.SIGTERM: "TERM", signal.SIGKILL: "KILL"}


@dataclass(frozen=True)
class Launch:
    """Everything needed to start a child, and to start it again the same way."""

    name: str
    argv: tuple[str, ...]
    # Children are stopped in tiers of groups (e.g. every gateway before any model server).
    group: str
    # stdout and stderr go here (appended: a restarted child keeps its earlier lines);
    # None discards them.
    log_path: Path | None = None
    cwd: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    # What the child gets when this process dies without stopping it (a crash, SIGKILL).
    death_signal: signal.Signals = signal.SIGTERM
    # Another user to run as (servemesh.procs.sandbox), with no capabilities and no way to
    # gain privileges; None: this process's user.
    run_as: RunAs | None = None


def with_death_signal(
    argv: Sequence[str], sig: signal.Signals, run_as: RunAs | None = None
) -> list[str]:
    """argv prefixed so that the child gets `sig` when its parent dies outright (and runs as
    `run_as`, when given).

    setpriv sets the parent-death signal (after any change of user, which would clear it)
    and execs the command. Doing it in Python between fork and exec (preexec_fn) is unsafe
    in a process with gRPC threads: children crashed with SIGSEGV before exec. Without
    setpriv, children are still stopped by PID; a child that must run as another user is
    not started at all.
    """
    if sig not in _SIGNAL_NAMES:
        raise ValueError(f"death signal {sig.name}: one of {[s.name for s in _SIGNAL_NAMES]}")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        if run_as is not None:
            raise SandboxError(f"no setpriv on PATH: cannot run {argv[0]} as uid {run_as.uid}")
        return list(argv)
    switch = run_as.setpriv_options() if run_as is not None else []
    return [setpriv, *switch, "--pdeathsig", _SIGNAL_NAMES[sig], "--", *argv]


class Spawner:
    """Forks children from one thread that lives until close().

    The parent-death signal follows the thread that forked the child, not the process: a
    child forked from a short-lived thread (one that asked for a restart, say) would get its
    signal as soon as that thread ended. So every child is forked from this one thread,
    which lives as long as the children it started.
    """

    def __init__(self, thread_name: str = "spawner") -> None:
        self._thread_name = thread_name
        self._pool: ThreadPoolExecutor | None = None

    def spawn(self, launch: Launch) -> subprocess.Popen[bytes]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        return self._pool.submit(_popen, launch).result()

    def close(self) -> None:
        """End the forking thread; call only once its children are stopped."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _popen(launch: Launch) -> subprocess.Popen[bytes]:
    # Unbuffered Python output: a child's log shows its last words when it dies.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **launch.env}
    argv = with_death_signal(launch.argv, launch.death_signal, launch.run_as)
    if launch.log_path is None:
        return _fork(argv, subprocess.DEVNULL, env, launch.cwd)
    launch.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Opened here, by this user: a child running as another user writes its log through
    # this descriptor and cannot open the file (nor any other log) itself.
    fd = os.open(launch.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        return _fork(argv, fd, env, launch.cwd)
    finally:
        os.close(fd)


def _fork(
    argv: list[str], out: int, env: dict[str, str], cwd: Path | None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        # Own session: a Ctrl-C in the terminal reaches the parent alone, which then stops
        # its children in order.
        start_new_session=True,
        # What a child creates is its user's alone (set by the fork itself, no preexec_fn).
        umask=PRIVATE_UMASK,
    )
