"""The state dir is the mesh's user's alone, whatever the operator's umask.

`servemesh up` (the launcher) sets the umask to 077 for itself and every child, makes the
state dir 0700 (it refuses a state dir of another user, or one others can write), tightens
what an earlier run left readable to others, and refuses a secret (control token, Redis
password, edge credentials, CA key) that another user owns or that group or others can read,
with the command that fixes it in the message.

The one exception: when model servers run as a user of their own (servemesh.procs.sandbox),
their group gets exactly what they need to read (see `Grant` and the launcher).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from servemesh.contract.errors import ServemeshError

PRIVATE_UMASK = 0o077
# Group and others: a private path has none of these bits.
SHARED_BITS = 0o077


class PrivacyError(ServemeshError, PermissionError):
    """A path of the state dir is not private to this user; the message says how to fix it."""


def restrict_umask() -> int:
    """Umask 077 from now on (files 0600, folders 0700 unless a mode says otherwise); the
    umask before."""
    return os.umask(PRIVATE_UMASK)


def private_dir(path: Path, mode: int = 0o700) -> Path:
    """`path` as a folder of `mode` (0700 by default), made if missing."""
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    os.chmod(path, mode)
    return path


def prepare_state_dir(root: Path) -> Path:
    """Make `root` this user's 0700 state dir; PrivacyError when it belongs to another user
    or others can write it (what they may have put there is not to be trusted)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = os.stat(root)
    euid = os.geteuid()
    if info.st_uid != euid:
        raise PrivacyError(
            f"{root} belongs to uid {info.st_uid}, not to this user (uid {euid}): "
            "use a state dir of your own (state_dir in the spec)"
        )
    if info.st_mode & 0o022:
        raise PrivacyError(
            f"{root} is mode {stat.S_IMODE(info.st_mode):04o}: other users can write it, so "
            f"what it holds cannot be trusted; check its contents, then run chmod 700 {root}"
        )
    os.chmod(root, 0o700)
    return root


def check_secret(path: Path) -> None:
    """PrivacyError unless `path` (when it exists) is this user's and only this user's."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    euid = os.geteuid()
    if info.st_uid != euid:
        raise PrivacyError(
            f"{path} belongs to uid {info.st_uid}, not to this user (uid {euid}): "
            f"another user may know it; remove it (rm {path}) and start again for a new one"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & SHARED_BITS:
        raise PrivacyError(f"{path} is mode {mode:04o}: run chmod 600 {path}")


def check_secrets(paths: Iterable[Path]) -> None:
    for path in paths:
        check_secret(path)


@dataclass(frozen=True)
class Grant:
    """A path of the state dir shared with one group on purpose, and the mode it gets."""

    path: Path
    gid: int
    mode: int

    def apply(self) -> None:
        os.chown(self.path, -1, self.gid)
        os.chmod(self.path, self.mode)


def tighten_tree(root: Path, keep: Iterable[Path] = ()) -> list[Path]:
    """Take the group and other bits off every path under `root` (itself included) but
    those in `keep` and what lies under them; the paths changed. An earlier run under a
    loose umask left them readable."""
    kept = {Path(p) for p in keep}
    changed: list[Path] = []

    def visit(path: Path) -> None:
        if path in kept:
            return
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(info.st_mode):
            return
        if info.st_mode & SHARED_BITS:
            os.chmod(path, stat.S_IMODE(info.st_mode) & ~SHARED_BITS)
            changed.append(path)
        if stat.S_ISDIR(info.st_mode):
            for child in sorted(path.iterdir()):
                visit(child)

    visit(root)
    return changed


def open_lock(path: Path, mode: str = "w") -> IO[str]:
    """A lock file opened for writing, created 0600: only this user can open it, so only
    this user can hold its flock. `mode` "w" opens it write-only, "r+" read-write (for a
    lock file that also holds a line); neither truncates it."""
    flags = os.O_CREAT | os.O_CLOEXEC | (os.O_RDWR if mode == "r+" else os.O_WRONLY)
    fd = os.open(path, flags, 0o600)
    return os.fdopen(fd, mode)


def private_file(path: Path) -> Path:
    """`path` created empty and 0600 if missing, else made 0600-at-most: for a file a
    library creates under the umask (SQLite, whose -wal and -shm files copy its mode)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & SHARED_BITS:
            os.fchmod(fd, mode & ~SHARED_BITS)
    finally:
        os.close(fd)
    return path
