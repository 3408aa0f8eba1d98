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
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from servemesh.contract.errors import ServemeshError

# "auto": the user model servers run as when the launcher is root.
AUTO_UID = 61000
AUTO_GID = 61000
# The user an offline model run (the push probe and kin: servemesh.sandbox) runs as when
# its caller is root: none of the model servers' files, nor anyone else's, are its own.
OFFLINE_UID = 61099
OFFLINE_GID = 61099


class SandboxError(ServemeshError, RuntimeError):
    """Model servers cannot run as the user asked for; the message says why."""


# A pool of model servers of its own runs as a user of its own, picked from this range by
# its name (the same pool, the same user, run after run): POOL_UID_FIRST + crc32(name) mod
# POOL_UID_COUNT, the next free one on a collision within the mesh.
POOL_UID_FIRST = 61100
POOL_UID_COUNT = 800


@dataclass(frozen=True)
class RunAs:
    """An unprivileged user (and group) a child runs as, with supplementary `groups` (none
    by default)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def group_options(self) -> list[str]:
        """setpriv's options for the groups: exactly `groups`, or none."""
        if self.groups:
            return ["--groups=" + ",".join(str(g) for g in self.groups)]
        return ["--clear-groups"]

    def setpriv_options(self) -> list[str]:
        """setpriv's options for this user, its groups only, no capabilities, no new
        privileges."""
        return [
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            *self.group_options(),
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
        ]


def pool_users(base: RunAs, pools: Sequence[str]) -> dict[str, RunAs]:
    """The user each pool's model servers run as. The shared pool ("") runs as `base`;
    each named pool as a uid and gid of its own, with `base`'s group as a supplementary one:
    what every model server reads is shared with that group, what one server alone holds
    (its key, its ledger) with its own. So a pool cannot read another pool's key, its
    ledger, nor its memory (/proc of another user), and signals none of its processes."""
    users: dict[str, RunAs] = {}
    taken = {base.uid}
    for pool in sorted(pools):
        if not pool:
            users[pool] = base
            continue
        offset = zlib.crc32(pool.encode()) % POOL_UID_COUNT
        while POOL_UID_FIRST + offset in taken:
            offset = (offset + 1) % POOL_UID_COUNT
        uid = POOL_UID_FIRST + offset
        taken.add(uid)
        users[pool] = RunAs(uid, uid, groups=(base.gid,))
    return users


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


def offline_user() -> RunAs | None:
    """Who a sandboxed offline model run runs as: a user of its own when this process is
    root; None (this process's user) otherwise, when file modes cannot keep them apart."""
    return RunAs(OFFLINE_UID, OFFLINE_GID) if os.geteuid() == 0 else None


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
