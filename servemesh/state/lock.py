"""One mesh per state dir: a mesh that starts (`servemesh up`, or any `Mesh`) holds its
state dir's lock for its whole life, so a second start there is refused instead of
rewriting the first mesh's files (its endpoints, its resolved spec, its Envoy configs).

The lock is an exclusive flock(2) on `<state>/mesh.lock`. The kernel drops it when its
holder exits, however it exits, so whether a mesh runs never rests on a PID alone (a
killed mesh's PID may belong to another process by now). The file names the holder (the
PID of the process that started the mesh, and its edge address): what a refusal prints,
and what `servemesh status` and `servemesh down` act on. A file that names a holder no
longer holding the lock was left by a mesh that was killed: the next start takes it over
and says so. A clean stop empties the file, so an empty file is a free state dir.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from servemesh.contract.errors import GATE_REFUSED, ServemeshError

LOCK_FILE = "mesh.lock"
# How long a start waits out a reader's brief shared hold (status, down, another start's
# check) before it calls the state dir taken.
TAKE_WAIT_S = 2.0


@dataclass(frozen=True)
class Holder:
    """The process that started the mesh holding a state dir, as its lock file names it."""

    pid: int
    edge: str
    started_at: float = 0.0

    def as_json(self) -> str:
        return json.dumps({"pid": self.pid, "edge": self.edge, "started_at": self.started_at})

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file names; None for an empty or unreadable one."""
        try:
            data = json.loads(text)
            return cls(int(data["pid"]), str(data["edge"]), float(data.get("started_at", 0)))
        except (ValueError, TypeError, KeyError):
            return None


class StateDirHeld(ServemeshError):
    """A live mesh holds the state dir a start was pointed at (exit 4: refused by a gate)."""

    exit_code = GATE_REFUSED

    def __init__(self, state_dir: Path, holder: Holder | None) -> None:
        who = "starting, pid not yet named"
        if holder is not None and holder.pid > 0:
            who = f"pid {holder.pid}, edge {holder.edge}"
        super().__init__(
            f"a mesh is already running from {state_dir} ({who}): stop it first "
            f"(`servemesh down --state-dir {state_dir}`), or give this one another --state-dir"
        )
        self.state_dir = state_dir
        self.holder = holder


def lock_path(state_dir: Path) -> Path:
    return Path(state_dir) / LOCK_FILE


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (a zombie counts: it has not been reaped)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _open(path: Path, flags: int) -> int | None:
    """The lock file's descriptor; None when there is none. Never follows a symlink: the
    state dir is checked for privacy only after the lock says it is free to use."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ServemeshError(f"{path} is a symlink: remove it (rm {path})") from None
        raise


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode(errors="replace")


def live_holder(state_dir: Path) -> Holder | None:
    """The mesh holding `state_dir` now; None when no live process holds it. A mesh between
    taking the lock and naming itself in it reads as pid 0."""
    fd = _open(lock_path(state_dir), os.O_RDONLY)
    if fd is None:
        return None
    try:
        try:
            # Shared and at once: free when no start holds it exclusively.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return Holder.parse(_read(fd)) or Holder(0, "")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def refuse_if_held(state_dir: Path) -> None:
    """StateDirHeld when a live mesh holds `state_dir` (before a start touches anything)."""
    holder = live_holder(state_dir)
    if holder is not None:
        raise StateDirHeld(Path(state_dir), holder)


class MeshLock:
    """A held state dir lock: released by `release()` (or the holder's exit)."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def take(cls, state_dir: Path, edge: str) -> tuple[MeshLock, Holder | None]:
        """Hold `state_dir` for this process's mesh at `edge`; with the holder a killed mesh
        left in the file, when it took that over (None: the state dir was free).
        StateDirHeld when a live mesh holds it."""
        path = lock_path(state_dir)
        Path(state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = _open(path, os.O_RDWR | os.O_CREAT)
        assert fd is not None  # created when missing
        try:
            _lock_exclusive(fd, Path(state_dir))
            left = Holder.parse(_read(fd))
            mine = Holder(os.getpid(), edge, time.time())
            os.ftruncate(fd, 0)
            os.pwrite(fd, mine.as_json().encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path), left

    def release(self) -> None:
        """Empty the file (a clean stop leaves no holder named) and let the lock go."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _lock_exclusive(fd: int, state_dir: Path) -> None:
    """The exclusive lock on `fd`, or StateDirHeld. A live holder is refused at once; a
    brief shared hold (a reader) or a holder not yet named is waited out a little."""
    deadline = time.monotonic() + TAKE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = Holder.parse(_read(fd))
            if (holder is not None and pid_alive(holder.pid)) or time.monotonic() > deadline:
                raise StateDirHeld(state_dir, holder) from None
        time.sleep(0.05)
