"""Forking children: a parent-death signal, a session of their own, one forking thread.

Every long-lived child of servemesh is forked here and nowhere else.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

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


def with_death_signal(argv: tuple[str, ...], sig: signal.Signals) -> list[str]:
    """argv prefixed so that the child gets `sig` when its parent dies outright.

    setpriv sets the parent-death signal and execs the command. Doing it in Python between
    fork and exec (preexec_fn) is unsafe in a process with gRPC threads: children crashed
    with SIGSEGV before exec. Without setpriv, children are still stopped by PID.
    """
    if sig not in _SIGNAL_NAMES:
        raise ValueError(f"death signal {sig.name}: one of {[s.name for s in _SIGNAL_NAMES]}")
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", _SIGNAL_NAMES[sig], "--", *argv] if setpriv else list(argv)


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
    argv = with_death_signal(launch.argv, launch.death_signal)
    if launch.log_path is None:
        return _fork(argv, subprocess.DEVNULL, env, launch.cwd)
    launch.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(launch.log_path, "ab") as log_file:
        return _fork(argv, log_file.fileno(), env, launch.cwd)


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
    )
