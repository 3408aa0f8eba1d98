"""A fork server: the mesh's own Python services forked from one interpreter that has
already imported them.

Every Python service of a mesh imports the same 900 modules (gRPC, protobuf, pydantic and
the spec's models, OpenTelemetry, prometheus-client, the service itself) before it does
anything: about a second of CPU each, seven times over for a default mesh, and again at
every restart. The fork server imports them once, then forks a child per service, which
runs the service's `python -m` entry as a fresh interpreter would (its own argv, environment,
working directory, umask, session, log and parent-death signal).

Only the mesh's own services, running as the mesh's own user, are forked this way (the
launcher names them): a model server, a process that runs as another user or in a zone's
network namespace is exec'd as before, so no sandbox ever shares memory with an interpreter
that served someone else. The server itself holds no secret: it is started with the
launcher's environment and is handed each child's (the same user's) only to pass it on.

The parent's side (`ForkServer`, `ForkedProcess`) looks like `subprocess.Popen` to the
supervisor: a PID, poll, wait, send_signal. The server reaps its children and reports each
exit status over the socket; signals go through a pidfd, so a PID reused after an exit is
never signalled. When the server cannot start (an import fails), the caller execs instead.

Wire: one SOCK_SEQPACKET socket pair, a JSON object per message; the child's log descriptor
travels with its request (SCM_RIGHTS).

    server -> parent   {"ready": pid}                 once, after the imports
    parent -> server   {"module", "args", "env", "cwd", "umask", "death_signal", "title"}
    server -> parent   {"pid": pid}                   the child forked for that request
                       {"error": why}                 or why it forked none
    server -> parent   {"exit": pid, "status": code}  a child exited (code as Popen's)
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from servemesh.procs.forkserver.wire import MAX_MESSAGE, send

MODULE = "servemesh.procs.forkserver"
# Generous: the imports take a few seconds on a loaded two-core host.
READY_TIMEOUT_S = 120.0
_SPAWN_TIMEOUT_S = 30.0


class ForkServerError(RuntimeError):
    """The fork server could not start, or stopped answering."""


def forkable(argv: Sequence[str], modules: Iterable[str]) -> bool:
    """Whether `argv` is `python -m <one of modules> ...`, run by this interpreter."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in modules


class ForkedProcess:
    """A child of the fork server, as the supervisor sees it: the part of
    `subprocess.Popen` it uses."""

    def __init__(self, pid: int, args: Sequence[str], death_signal: int) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._death_signal = death_signal
        self._exited = threading.Event()
        # Set when the server is gone: the exit is then read from the pidfd.
        self._orphan = False
        self._lock = threading.Lock()
        # Opened as soon as the PID is known (the server reaps only after it has answered),
        # so a signal can never reach a process that reused the PID.
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None

    def _set_exit(self, status: int) -> None:
        with self._lock:
            if self.returncode is None:
                self.returncode = status
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        self._exited.set()

    def _orphaned(self) -> None:
        """The server is gone without a word on this child: the child gets its death
        signal, so its exit is read from its pidfd, with that signal as its status."""
        self._orphan = True
        self._check_orphan(0)

    def _check_orphan(self, timeout_s: float | None) -> None:
        if not self._orphan or self._exited.is_set():
            return
        if self._pidfd is None or _pidfd_done(self._pidfd, timeout_s):
            self._set_exit(-self._death_signal)

    def poll(self) -> int | None:
        self._check_orphan(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._orphan:
            self._check_orphan(timeout)
        if not self._exited.wait(0 if self._orphan else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is not None or self._pidfd is None:
                return  # as Popen: nothing to signal once it is known to have exited
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _pidfd_done(pidfd: int, timeout_s: float | None) -> bool:
    readable, _, _ = select.select([pidfd], [], [], timeout_s)
    return bool(readable)


class ForkServer:
    """One fork server process and the children it forked for this owner.

    Start it from the thread that forks the owner's other children (its parent-death signal
    follows that thread); close it only once its children are stopped.
    """

    def __init__(
        self,
        allowed: Mapping[str, Sequence[str]],
        log_path: Path | None = None,
        *,
        undumpable: bool = False,
    ) -> None:
        # module it may run -> the modules to import for it beforehand
        self.allowed = dict(allowed)
        self.log_path = log_path
        # Not dumpable (PR_SET_DUMPABLE 0, which its forks keep): no process of its user
        # reads or writes its memory through /proc or ptrace.
        self.undumpable = undumpable
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._children: dict[int, ForkedProcess] = {}
        self._replies: queue.Queue[ForkedProcess | str] = queue.Queue()
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        # The request being answered (one at a time): its argv and death signal.
        self._inflight: tuple[list[str], int] = ([], int(signal.SIGTERM))

    @property
    def pid(self) -> int | None:
        """The server's PID while it runs."""
        return None if self._process is None else self._process.pid

    def runs(self, argv: Sequence[str]) -> bool:
        """Whether `argv` is `python -m <a module this server runs> ...`."""
        return forkable(argv, self.allowed)

    def start(self, argv_prefix: Sequence[str] = ()) -> None:
        """Start the server and wait until it has imported everything (ForkServerError,
        with its log's tail, when it cannot)."""
        self.launch(argv_prefix)
        self.wait_ready()

    def launch(self, argv_prefix: Sequence[str] = ()) -> None:
        """Start the server's process without waiting for its imports (wait_ready() does,
        and spawn() waits for them first). `argv_prefix`: what to run it under (setpriv
        for its own parent-death signal)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [*argv_prefix, sys.executable, "-m", MODULE, "--socket-fd", str(theirs.fileno())]
        for module in self.allowed:
            argv += ["--allow", module]
        for module in dict.fromkeys(m for mods in self.allowed.values() for m in mods):
            argv += ["--preload", module]
        if self.undumpable:
            argv.append("--undumpable")
        out: int = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            out = os.open(
                self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        try:
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=[theirs.fileno()],
                start_new_session=True,
            )
        finally:
            theirs.close()
            if out != subprocess.DEVNULL:
                os.close(out)
        self._sock = ours

    def wait_ready(self) -> None:
        """Return once the server has imported everything; ForkServerError (with its log's
        tail, the server stopped) when it cannot."""
        if self._reader is not None:
            return
        if self._sock is None:
            raise ForkServerError("the fork server is not running")
        readable, _, _ = select.select([self._sock], [], [], READY_TIMEOUT_S)
        hello = json.loads(self._sock.recv(MAX_MESSAGE) or b"{}") if readable else {}
        if "ready" not in hello:
            self.close()
            raise ForkServerError(f"the fork server did not start; its log:\n{self._log_tail()}")
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path | None,
        umask: int,
        death_signal: int,
        out_fd: int | None,
    ) -> ForkedProcess:
        """Fork `argv` (a `python -m` line this server runs); its output goes to `out_fd`
        (None: discarded)."""
        self.wait_ready()
        assert self._sock is not None
        request = {
            "module": argv[2],
            "args": list(argv[3:]),
            "env": dict(env),
            "cwd": None if cwd is None else str(cwd),
            "umask": umask,
            "death_signal": int(death_signal),
            "title": " ".join(argv),
        }
        with self._lock:
            self._inflight = (list(argv), int(death_signal))
            send(self._sock, request, [] if out_fd is None else [out_fd])
            try:
                reply = self._replies.get(timeout=_SPAWN_TIMEOUT_S)
            except queue.Empty:
                raise ForkServerError(f"the fork server did not answer; its log:\n"
                                      f"{self._log_tail()}") from None  # fmt: skip
        if isinstance(reply, str):
            raise ForkServerError(reply)
        return reply

    def _read(self) -> None:
        """Replies and exit reports, in the order the server sent them: a child's PID
        always comes before its exit."""
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "pid" in message:
                argv, death_signal = self._inflight
                child = ForkedProcess(int(message["pid"]), argv, death_signal)
                self._children[child.pid] = child
                self._replies.put(child)
            elif "exit" in message:
                exited = self._children.pop(int(message["exit"]), None)
                if exited is not None:
                    exited._set_exit(int(message["status"]))
            elif "error" in message:
                self._replies.put(str(message["error"]))
        self._replies.put("the fork server exited")
        for child in list(self._children.values()):
            child._orphaned()

    def close(self) -> None:
        """Close the socket (the server then exits) and wait for it. Idempotent."""
        if self._sock is not None:
            # shutdown, not close alone: the reader thread blocked in recv holds the socket
            # open, and the server would never see its end.
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
            self._process = None
        if self._reader is not None:
            self._reader.join(timeout=5)
            self._reader = None

    def _log_tail(self, lines: int = 25) -> str:
        if self.log_path is None:
            return "(output discarded)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
