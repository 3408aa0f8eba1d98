"""The state dir's privacy without a mesh: secrets with a loose mode or another owner are
refused (the fix in the message), lock files are 0600 and opened for writing, atomic
writes are 0600 whatever the umask, children run under umask 077, and a service's control
check holds a digest that is not itself a token."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.control_credential import (
    CONTROL_VERIFIER_ENV,
    control_metadata,
    control_token_path,
    control_verifier,
    ensure_control_token,
    read_control_token,
    token_digest,
)
from servemesh.contract.private import PrivacyError, open_lock, prepare_state_dir
from servemesh.procs import Supervisor, ensure_redis_password
from servemesh.procs.sandbox import RunAs, model_user, unreachable
from servemesh.procs.spawn import with_death_signal
from servemesh.services.runtime.control_auth import ControlAuth
from servemesh.state.credentials import ensure_edge_credentials, read_edge_credentials
from servemesh.state.sharing import secure_state_dir


@pytest.fixture
def loose_umask() -> Iterator[None]:
    before = os.umask(0)
    try:
        yield
    finally:
        os.umask(before)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_readable_control_token_is_refused_with_the_fix(tmp_path: Path) -> None:
    ensure_control_token(tmp_path)
    path = control_token_path(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(PrivacyError, match=f"{path} is mode 0644: run chmod 600 {path}"):
        read_control_token(tmp_path)
    with pytest.raises(PrivacyError):
        ensure_control_token(tmp_path)  # reused only when private
    os.chmod(path, 0o600)
    assert read_control_token(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_secret_of_another_user_is_refused(tmp_path: Path) -> None:
    ensure_control_token(tmp_path)
    os.chown(control_token_path(tmp_path), 61000, 61000)
    with pytest.raises(PrivacyError, match="belongs to uid 61000"):
        read_control_token(tmp_path)


def test_redis_password_edge_credentials_and_ca_key_are_checked_too(tmp_path: Path) -> None:
    password = tmp_path / "redis-password"
    ensure_redis_password(password)
    ensure_edge_credentials(tmp_path)
    os.chmod(password, 0o640)
    os.chmod(tmp_path / "edge-credentials", 0o604)
    with pytest.raises(PrivacyError, match="mode 0640: run chmod 600"):
        ensure_redis_password(password)
    with pytest.raises(PrivacyError, match="mode 0604"):
        read_edge_credentials(tmp_path)
    state = tmp_path / "state"
    secure_state_dir(state)  # a fresh dir passes
    (state / "tls" / "ca").mkdir(parents=True)
    (state / "tls" / "ca" / "ca.key").write_text("key")
    os.chmod(state / "tls" / "ca" / "ca.key", 0o644)
    with pytest.raises(PrivacyError, match="ca.key is mode 0644"):
        secure_state_dir(state)


def test_the_state_dir_is_made_0700_and_one_others_can_write_is_refused(
    tmp_path: Path, loose_umask: None
) -> None:
    fresh = prepare_state_dir(tmp_path / "fresh")
    assert _mode(fresh) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(PrivacyError, match=f"{open_dir} is mode 0777.*chmod 700"):
        prepare_state_dir(open_dir)
    readable = tmp_path / "readable"
    readable.mkdir()
    os.chmod(readable, 0o755)
    assert _mode(prepare_state_dir(readable)) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_state_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 61000, 61000)
    with pytest.raises(PrivacyError, match="belongs to uid 61000"):
        prepare_state_dir(theirs)


def test_lock_files_are_0600_and_opened_for_writing(tmp_path: Path, loose_umask: None) -> None:
    with open_lock(tmp_path / "changes.lock", "r+") as handle:
        handle.write("123")
        handle.flush()
        flags = os.get_blocking(handle.fileno()), handle.writable()
        assert flags[1]
    with open_lock(tmp_path / "changes.lock") as handle:
        assert handle.writable() and not handle.readable()
    assert _mode(tmp_path / "changes.lock") == 0o600
    assert (tmp_path / "changes.lock").read_text() == "123"  # opening truncates nothing


def test_atomic_writes_are_private_whatever_the_umask_and_keep_a_granted_group(
    tmp_path: Path, loose_umask: None
) -> None:
    path = tmp_path / "spec.yaml"
    atomic_write_text(path, "a")
    assert _mode(path) == 0o600
    os.chmod(path, 0o644)  # an earlier run's: others lose their bits on a rewrite
    atomic_write_text(path, "b")
    assert _mode(path) == 0o640
    shared = tmp_path / "faults"
    shared.mkdir()
    os.chmod(shared, 0o2750)
    atomic_write_text(shared / "model.json", "{}")
    assert _mode(shared / "model.json") == 0o640


def test_children_run_under_umask_077(tmp_path: Path, loose_umask: None) -> None:
    with Supervisor(tmp_path / "logs") as supervisor:
        made = tmp_path / "made"
        child = supervisor.start("umask", ["sh", "-c", f"umask; : > '{made}'"], timeout_s=None)
        child.wait(10)
    assert (tmp_path / "logs" / "umask.log").read_text().strip() == "0077"
    assert _mode(tmp_path / "logs" / "umask.log") == 0o600
    assert _mode(made) == 0o600  # what the child itself creates


def test_a_service_checks_a_digest_and_the_digest_is_no_token() -> None:
    token = "the-operators-token"
    auth = ControlAuth(
        control_verifier("/nonexistent", {CONTROL_VERIFIER_ENV: token_digest(token)})
    )
    assert auth.refusal(control_metadata(token)) is None
    digest = token_digest(token)
    for held in (digest, f"sha256:{digest}", "a-token-of-another-mesh"):
        refused = auth.refusal(control_metadata(held))
        assert refused is not None and refused[0] == grpc.StatusCode.PERMISSION_DENIED
    assert ControlAuth(None).refusal(control_metadata(token)) is not None
    assert token not in repr(vars(ControlAuth(token)))


def test_the_model_user_is_switched_by_setpriv_without_privileges() -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv")
    argv = with_death_signal(("python",), __import__("signal").SIGTERM, RunAs(61000, 61000))
    for option in ("--reuid=61000", "--regid=61000", "--clear-groups", "--no-new-privs"):
        assert option in argv
    assert argv.index("--pdeathsig") < argv.index("--")


def test_model_user_falls_back_loudly_when_the_state_dir_is_out_of_reach(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "state").mkdir(parents=True)
    os.chmod(closed, 0o700)
    blocked = unreachable(closed / "state", RunAs(61000, 61000))
    assert blocked is not None and (blocked == closed or blocked in closed.parents)
    run_as, why = model_user("auto", closed / "state")
    if os.geteuid() != 0:
        assert run_as is None and "not root" in why
    elif unreachable(closed / "state", RunAs(61000, 61000)) is not None:
        assert run_as is None and "not isolated" in why and "chmod o+x" in why
    assert model_user("off", closed / "state")[0] is None
