"""The fork server itself (`python -m servemesh.procs.forkserver`): imports the modules it
is told to, then forks a child per request; each child becomes `python -m <module>` as the
request describes it. It reaps its children and reports each exit."""

from __future__ import annotations

import argparse
import ctypes
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from servemesh.procs.forkserver.wire import MAX_MESSAGE, send

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NAME = 15


@dataclass(frozen=True)
class Job:
    """What a forked child runs: `python -m module *args`, as the request described it."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str | None
    umask: int
    death_signal: int
    title: str
    out_fd: int | None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servemesh.procs.forkserver")
    parser.add_argument("--socket-fd", type=int, required=True)
    parser.add_argument("--allow", action="append", default=[], help="a module it may run")
    parser.add_argument("--preload", action="append", default=[], help="a module to import")
    parser.add_argument("--undumpable", action="store_true", help="PR_SET_DUMPABLE 0 first")
    args = parser.parse_args(argv)
    if args.undumpable:
        _set_dumpable(False)
    sock = socket.socket(fileno=args.socket_fd)
    for name in args.preload:
        importlib.import_module(name)
    # setproctitle finds the argv area to write a child's title in now, while sys.argv
    # is still this process's own (it refuses once sys.argv was changed).
    import setproctitle

    setproctitle.getproctitle()

    sys.stdout.flush()
    sys.stderr.flush()
    send(sock, {"ready": os.getpid()})
    job = _serve(sock, frozenset(args.allow))
    if job is None:
        return 0
    # In a forked child from here on: the server's loop is behind us.
    _become(job)
    runpy.run_module(job.module, run_name="__main__", alter_sys=True)
    return 0


def _serve(sock: socket.socket, allowed: frozenset[str]) -> Job | None:
    """Fork a child per request until the parent closes the socket (None), or return, in a
    child, the job it is to run."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    server_pid = os.getpid()
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in readable:
            _drain(wake_r)
            _report_exits(sock)
        if sock.fileno() not in readable:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
        if not data:
            return None  # the parent is done (or gone): the children get their signal
        request = json.loads(data)
        module = str(request["module"])
        if module not in allowed:
            for fd in fds:
                os.close(fd)
            send(sock, {"error": f"module {module!r} is not one this server runs"})
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r)
            os.close(wake_w)
            sock.close()
            _watch_parent(int(request["death_signal"]), server_pid)
            return Job(
                module=module,
                args=[str(a) for a in request["args"]],
                env={str(k): str(v) for k, v in request["env"].items()},
                cwd=request.get("cwd"),
                umask=int(request["umask"]),
                death_signal=int(request["death_signal"]),
                title=str(request["title"]),
                out_fd=fds[0] if fds else None,
            )
        for fd in fds:
            os.close(fd)
        send(sock, {"pid": pid})


def _set_dumpable(dumpable: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, int(dumpable), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")


def _watch_parent(sig: int, server_pid: int) -> None:
    """The child gets `sig` when the server dies (and the server dies with its owner)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        os._exit(70)
    if os.getppid() != server_pid:  # it died before the signal was set
        os._exit(70)


def _become(job: Job) -> None:
    """Turn this forked child into the process `python -m job.module` would have been."""
    os.setsid()
    os.umask(job.umask)
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = job.out_fd if job.out_fd is not None else os.open(os.devnull, os.O_WRONLY)
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in {stdin, out} - {0, 1, 2}:
        os.close(fd)
    if job.cwd is not None:
        os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    # What `python -u` gives: every write reaches the log at once, so a child's log shows
    # its last words when it dies.
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )
    sys.argv = ["-m", *job.args]  # runpy puts the module's path first, as -m does
    import setproctitle

    # `ps` and /proc/<pid>/cmdline show the service, not the server it was forked from; the
    # short name (/proc/<pid>/comm) stays the interpreter's, as for an exec'd service.
    setproctitle.setproctitle(job.title)
    # prctl, not /proc/self/comm: an undumpable process's /proc files are root's.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, Path(sys.executable).name[:15].encode(), 0, 0, 0)


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(sock, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
