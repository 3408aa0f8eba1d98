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
    first of them (or at prepare()) and stays until close(). `forked_as`: the same for
    modules started as another user (a RunAs): one fork server per such user, running as
    that user, so that what it forks never shares memory with another user's processes.
    Where a server cannot start, its modules are exec'd.
    """

    def __init__(
        self,
        thread_name: str = "spawner",
        *,
        forked: Mapping[str, Sequence[str]] | None = None,
        forked_as: Mapping[str, Sequence[str]] | None = None,
        logs_dir: Path | None = None,
    ) -> None:
        self._thread_name = thread_name
        self._pool: ThreadPoolExecutor | None = None
        self._forked = dict(forked or {})
        self._forked_as = dict(forked_as or {})
        self._logs_dir = logs_dir
        # By the user they run as (None: this process's own).
        self._servers: dict[RunAs | None, ForkServer] = {}
        self._failed: set[RunAs | None] = set()

    def spawn(self, launch: Launch) -> Process:
        return self._thread().submit(self._start, launch).result()

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        return self._pool

    def _start(self, launch: Launch) -> Process:
        server = self._fork_server(launch)
        if server is None:
            return _popen(launch)
        return _with_log(launch, lambda out: server.spawn(
            launch.argv, env=_child_env(launch), cwd=launch.cwd, umask=PRIVATE_UMASK,
            death_signal=launch.death_signal, out_fd=out,
        ))  # fmt: skip

    def prepare(self) -> None:
        """Start this user's fork server now, without waiting for its imports, so that
        they overlap with whatever the owner does before its first service starts. Nothing
        when there is none to start."""
        if self._forked:
            self._thread().submit(self._launch_server, None).result()

    def _modules(self, user: RunAs | None) -> dict[str, Sequence[str]]:
        return self._forked if user is None else self._forked_as

    def _launch_server(self, user: RunAs | None) -> ForkServer | None:
        """`user`'s fork server, its process started now if need be; None once it failed."""
        if user in self._failed:
            return None
        if user in self._servers:
            return self._servers[user]
        name = "forkserver.log" if user is None else f"forkserver-{user.uid}.log"
        server = ForkServer(
            self._modules(user),
            None if self._logs_dir is None else self._logs_dir / name,
            # Another user's server: no process of that user (a model server) may read or
            # write its memory, nor that of the children it forks.
            undumpable=user is not None,
        )
        try:
            server.launch(with_death_signal([], signal.SIGKILL, user))
        except (OSError, SandboxError) as exc:
            self._no_server(user, exc)
            return None
        self._servers[user] = server
        return server

    def _no_server(self, user: RunAs | None, why: Exception) -> None:
        whose = "" if user is None else f" (uid {user.uid})"
        log.warning("no fork server%s, its services are exec'd: %s", whose, why)
        self._failed.add(user)
        self._servers.pop(user, None)

    def _fork_server(self, launch: Launch) -> ForkServer | None:
        """The fork server of the user `launch` runs as, ready, when `launch` is one of its
        modules (started now if need be, in the forking thread); else None: exec it."""
        if not forkable(launch.argv, self._modules(launch.run_as)):
            return None
        server = self._launch_server(launch.run_as)
        if server is None:
            return None
        try:
            server.wait_ready()
        except ForkServerError as exc:
            self._no_server(launch.run_as, exc)
            return None
        return server

    def server_pids(self) -> dict[str, int]:
        """The running fork servers' PIDs, by the name of their log ("forkserver", or
        "forkserver-<uid>" for another user's)."""
        return {
            "forkserver" if user is None else f"forkserver-{user.uid}": server.pid
            for user, server in self._servers.items()
            if server.pid is not None
        }

    def close(self) -> None:
        """End the forking thread (and the fork servers); call only once their children
        are stopped."""
        if self._pool is not None:
            for server in self._servers.values():
                self._pool.submit(server.close).result()
            self._servers.clear()
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
