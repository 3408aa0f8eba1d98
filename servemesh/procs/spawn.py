"""Forking children: a parent-death signal, a session of their own, one forking thread.

Every long-lived child of servemesh is forked here and nowhere else: exec'd, or, for the
mesh's own Python services when the owner names them, forked from a fork server that has
imported them already (servemesh.procs.forkserver).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from servemesh.contract.private import PRIVATE_UMASK
from servemesh.procs.forkserver import ForkServer, ForkServerError, forkable
from servemesh.procs.sandbox import RunAs, SandboxError

log = logging.getLogger(__name__)
_P = TypeVar("_P")

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


class Process(Protocol):
    """A started child as its owner handles it: `subprocess.Popen`, or a child of the fork
    server (servemesh.procs.forkserver.ForkedProcess)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class Spawner:
    """Forks children from one thread that lives until close().

    The parent-death signal follows the thread that forked the child, not the process: a
    child forked from a short-lived thread (one that asked for a restart, say) would get its
    signal as soon as that thread ended. So every child is forked from this one thread,
    which lives as long as the children it started.

    `forked`: the `python -m` modules started through a fork server instead (module -> the
    modules it imports first), when they run as this user; the server starts with the
    first of them and stays until close(). Where it cannot start, they are exec'd.
    """

    def __init__(
        self,
        thread_name: str = "spawner",
        *,
        forked: Mapping[str, Sequence[str]] | None = None,
        logs_dir: Path | None = None,
    ) -> None:
        self._thread_name = thread_name
        self._pool: ThreadPoolExecutor | None = None
        self._forked = dict(forked or {})
        self._logs_dir = logs_dir
        self._server: ForkServer | None = None
        self._server_failed = False

    def spawn(self, launch: Launch) -> Process:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        return self._pool.submit(self._start, launch).result()

    def _start(self, launch: Launch) -> Process:
        server = self._fork_server(launch)
        if server is None:
            return _popen(launch)
        return _with_log(launch, lambda out: server.spawn(
            launch.argv, env=_child_env(launch), cwd=launch.cwd, umask=PRIVATE_UMASK,
            death_signal=launch.death_signal, out_fd=out,
        ))  # fmt: skip

    def prepare(self) -> None:
        """Start the fork server now, without waiting for its imports, so that they overlap
        with whatever the owner does before its first service starts. Nothing when there
        is none to start."""
        if self._forked and self._server is None and not self._server_failed:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
            self._pool.submit(self._launch_server).result()

    def _launch_server(self) -> None:
        if self._server is not None or self._server_failed:
            return
        server = ForkServer(
            self._forked,
            None if self._logs_dir is None else self._logs_dir / "forkserver.log",
        )
        try:
            server.launch(with_death_signal([], signal.SIGKILL))
        except OSError as exc:
            self._no_server(exc)
            return
        self._server = server

    def _no_server(self, why: Exception) -> None:
        log.warning("no fork server, services are exec'd: %s", why)
        self._server_failed = True
        self._server = None

    def _fork_server(self, launch: Launch) -> ForkServer | None:
        """The fork server, ready, when `launch` is one of its modules and runs as this user
        (started now if need be, in the forking thread); else None: exec it."""
        if launch.run_as is not None or not self._forked:
            return None
        if not forkable(launch.argv, self._forked):
            return None
        self._launch_server()
        if self._server is None:
            return None
        try:
            self._server.wait_ready()
        except ForkServerError as exc:
            self._no_server(exc)
            return None
        return self._server

    def close(self) -> None:
        """End the forking thread (and the fork server); call only once its children are
        stopped."""
        if self._pool is not None:
            if self._server is not None:
                self._pool.submit(self._server.close).result()
                self._server = None
            self._pool.shutdown()
            self._pool = None


def _child_env(launch: Launch) -> dict[str, str]:
    # Unbuffered Python output: a child's log shows its last words when it dies.
    return {**os.environ, "PYTHONUNBUFFERED": "1", **launch.env}


def _popen(launch: Launch) -> subprocess.Popen[bytes]:
    argv = with_death_signal(launch.argv, launch.death_signal, launch.run_as)
    return _with_log(
        launch,
        lambda out: _fork(
            argv, subprocess.DEVNULL if out is None else out, _child_env(launch), launch.cwd
        ),
    )


def _with_log(launch: Launch, start: Callable[[int | None], _P]) -> _P:
    """`start` given the child's log descriptor (None: output discarded), closed after."""
    if launch.log_path is None:
        return start(None)
    launch.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Opened here, by this user: a child running as another user writes its log through
    # this descriptor and cannot open the file (nor any other log) itself.
    fd = os.open(launch.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        return start(fd)
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
