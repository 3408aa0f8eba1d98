"""What `servemesh up` does to keep its state dir private (servemesh.contract.private), and what
it shares with model servers that run as a user of their own (servemesh.procs.sandbox).

Private: the state dir 0700, every file 0600 and folder 0700, under umask 077 for the
launcher and every child. Secrets another user owns or others may read are refused.

Shared with the model servers' group, when they run as another user (nothing else):

    <state>/                      0710  pass through, not list
    <state>/mesh.resolved.yaml    0640  the spec they serve (rewrites keep the group)
    <state>/faults/               2750  the fault drills' files (new ones are 0640)
    <state>/faults/applied/       2770  where each acknowledges its fault settings
    <state>/shadow/               2770  where each writes its shadow ledger
    <state>/inflight/             2770  where each keeps its in-flight journal
    <state>/tls/                  0710  pass through, not list
    <state>/tls/trust.pem         0640  the CA certificate (public)
    <state>/tls/<model server>/   0750  its own certificate and key, 0640 (MeshIdentity.share)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from servemesh.contract.control_credential import control_token_path
from servemesh.contract.inflight import INFLIGHT_DIR, journal_path
from servemesh.contract.private import (
    Grant,
    check_secrets,
    prepare_state_dir,
    private_dir,
    restrict_umask,
    tighten_tree,
)
from servemesh.identity.store import MeshIdentity
from servemesh.procs.sandbox import RunAs
from servemesh.spec import REDIS_PASSWORD_FILE
from servemesh.state.credentials import credentials_path

FAULTS_DIR = "faults"
FAULTS_APPLIED_DIR = "applied"  # services.runtime.faults.APPLIED_DIR
SHADOW_DIR = "shadow"


def secret_paths(root: Path) -> list[Path]:
    """The secrets a state dir may hold: refused when not private."""
    return [
        control_token_path(root),
        root / REDIS_PASSWORD_FILE,
        credentials_path(root),
        root / "tls" / "ca" / "ca.key",
    ]


def secure_state_dir(root: Path) -> None:
    """Umask 077 from now on, `root` this user's 0700 dir, its secrets checked
    (servemesh.contract.private.PrivacyError names the path and the fix)."""
    restrict_umask()
    prepare_state_dir(root)
    check_secrets(secret_paths(root))


def tighten(root: Path) -> list[Path]:
    """Every path under `root` private again (what an earlier run, or an earlier run's
    grants, left open); the paths changed."""
    return tighten_tree(root)


def model_grants(root: Path, resolved_spec: Path, identity: MeshIdentity, gid: int) -> list[Grant]:
    """What the model servers' group is given (see the module's table), folders made."""
    private_dir(root / FAULTS_DIR)
    private_dir(root / FAULTS_DIR / FAULTS_APPLIED_DIR)
    private_dir(root / SHADOW_DIR)
    private_dir(root / INFLIGHT_DIR)
    return [
        Grant(root, gid, 0o710),
        Grant(resolved_spec, gid, 0o640),
        Grant(root / FAULTS_DIR, gid, 0o2750),
        *(Grant(f, gid, 0o640) for f in _files(root / FAULTS_DIR)),
        # Sticky: a model server (of any pool) removes or replaces only its own files.
        Grant(root / FAULTS_DIR / FAULTS_APPLIED_DIR, gid, 0o3770),
        Grant(root / SHADOW_DIR, gid, 0o3770),
        # Sticky too: a server replaces only its own journal; the launcher (the folder's
        # owner) reads and removes a crashed one's.
        Grant(root / INFLIGHT_DIR, gid, 0o3770),
        Grant(identity.root, gid, 0o710),
        Grant(identity.trust_file, gid, 0o640),
    ]


def share_with_models(
    root: Path, resolved_spec: Path, identity: MeshIdentity, run_as: RunAs
) -> None:
    for grant in model_grants(root, resolved_spec, identity, run_as.gid):
        grant.apply()
    # Ledgers and acknowledgements an earlier run of a model server (as another user)
    # wrote: theirs now.
    for written in (
        *_files(root / SHADOW_DIR),
        *_files(root / FAULTS_DIR / FAULTS_APPLIED_DIR),
        *_files(root / INFLIGHT_DIR),
    ):
        os.chown(written, run_as.uid, run_as.gid)


def share_identity(identity: MeshIdentity, names: Iterable[str], run_as: RunAs) -> None:
    for name in names:
        identity.share(name, run_as.gid)


def own_written(root: Path, instance: str, run_as: RunAs) -> None:
    """The files a model server writes (its shadow ledger, its fault acknowledgement, its
    in-flight journal) are its user's: an earlier run may have been another pool's user,
    or the shared one."""
    for written in (
        root / SHADOW_DIR / f"{instance}.jsonl",
        root / FAULTS_DIR / FAULTS_APPLIED_DIR / f"{instance}.json",
        journal_path(root, instance),
    ):
        if written.is_file() and not written.is_symlink():
            os.chown(written, run_as.uid, run_as.gid)


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.is_file() and not p.is_symlink()]
