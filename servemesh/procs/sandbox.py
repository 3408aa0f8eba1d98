"""Model servers run as a user of their own, when the mesh runs as root.

A model file is code: whatever runs in a model server process can do what that process's
user can. Started as root, every model server would read the CA's key, the control token
and the Redis password. So when the launcher is root, model servers run as another user
(`sandbox.model_user` in the spec; "auto": uid and gid 61000, which need no entry in
/etc/passwd) with no supplementary groups, no capabilities (an empty bounding set) and no
way to gain privileges (PR_SET_NO_NEW_PRIVS: a setuid binary gives it nothing). That
user's group is granted, by the launcher, exactly what a model server reads: a way into
the state dir (search, not list), the resolved spec, the fault files, its own identity's
folder and the trust bundle, and a folder to write its shadow ledger in. Its log is opened
by the launcher. Everything else in the state dir stays 0700/0600 and the launcher's.

Not root: every process of the mesh is one user, file modes cannot keep them apart, and
this module does nothing (`model_user` other than auto/off is then refused). Run such a
mesh as a user of its own, with nothing else of value readable by that user.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from servemesh.errors import ServemeshError

# "auto": the user model servers run as when the launcher is root.
AUTO_UID = 61000
AUTO_GID = 61000


class SandboxError(ServemeshError, RuntimeError):
    """Model servers cannot run as the user asked for; the message says why."""


@dataclass(frozen=True)
class RunAs:
    """An unprivileged user (and group) a child runs as."""

    uid: int
    gid: int

    def setpriv_options(self) -> list[str]:
        """setpriv's options for this user, no groups, no capabilities, no new privileges."""
        return [
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
        ]


def parse_user(value: str) -> RunAs:
    """`uid`, `uid:gid` or a user name (its primary group)."""
    user, _, group = value.partition(":")
    if user.isdigit():
        uid = int(user)
        gid = int(group) if group.isdigit() else uid
    else:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise SandboxError(f"sandbox.model_user: no user named {user!r}") from None
        uid, gid = entry.pw_uid, int(group) if group.isdigit() else entry.pw_gid
    if uid == 0 or gid == 0:
        raise SandboxError("sandbox.model_user: not root (uid and gid 0 read every secret)")
    return RunAs(uid, gid)


def unreachable(path: Path, run_as: RunAs) -> Path | None:
    """The first folder above `path` that `run_as` may not pass (search), None when none."""
    for folder in reversed(path.parents):
        info = os.stat(folder)
        if info.st_uid == run_as.uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid == run_as.gid:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            return folder
    return None


def model_user(setting: str, state_dir: Path) -> tuple[RunAs | None, str]:
    """The user model servers of a mesh whose state dir is `state_dir` run as (None: the
    launcher's own), and a line saying why. SandboxError when an explicit user cannot be."""
    if setting == "off":
        return None, "sandbox.model_user is off: model servers run as the mesh's user"
    root = os.geteuid() == 0
    if setting == "auto":
        if not root:
            return None, "not root: model servers run as the mesh's user (see docs)"
        run_as = RunAs(AUTO_UID, AUTO_GID)
    else:
        if not root:
            raise SandboxError(
                f"sandbox.model_user {setting!r}: only root can start processes as another user"
            )
        run_as = parse_user(setting)
    blocked = unreachable(state_dir, run_as)
    if blocked is not None:
        mode = stat.S_IMODE(os.stat(blocked).st_mode)
        why = (
            f"uid {run_as.uid} cannot reach the state dir {state_dir}: {blocked} is mode "
            f"{mode:04o}; put the state dir where other users may pass (e.g. chmod o+x "
            f"{blocked})"
        )
        if setting != "auto":
            raise SandboxError(why)
        return None, f"model servers run as root, not isolated: {why}"
    return run_as, f"model servers run as uid {run_as.uid} gid {run_as.gid}"
