"""A mesh started as root under umask 000: its state dir is private all the same, its model
servers run as a user of their own who cannot open the mesh's secrets, and no service holds
a control token (the gateway not even the digest the others check calls against).

The state dir sits where other users may pass (pytest's own tmp dir is 0700, which would
leave model servers as root: servemesh.procs.sandbox says why and warns)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from servemesh.contract.control_credential import (
    CONTROL_VERIFIER_ENV,
    control_metadata,
    read_control_token,
    token_digest,
)
from servemesh.identity import dial_edge, dial_registry, mesh_identity
from servemesh.launcher import Mesh
from servemesh.procs.sandbox import AUTO_GID, AUTO_UID, RunAs, pool_users
from servemesh.spec import REDIS_PASSWORD_FILE
from servemesh.state.sharing import model_grants
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2 as pb
from servemesh_api.registry.v1 import registry_pb2_grpc
from tests.mesh.conftest import test_mesh_spec

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="model servers run as another user only when the mesh runs as root (setpriv)",
)


@pytest.fixture(scope="module")
def isolated() -> Iterator[Mesh]:
    parent = Path(tempfile.mkdtemp(prefix="servemesh-isolation-"))
    os.chmod(parent, 0o711)  # others may pass, not list: as /home/<user> often is
    before = os.umask(0)
    try:
        mesh = Mesh.from_spec(test_mesh_spec(str(parent / "state")))
        with mesh:
            yield mesh
    finally:
        os.umask(before)
        shutil.rmtree(parent, ignore_errors=True)


def _model_servers(mesh: Mesh) -> dict[str, int]:
    return mesh.pids_of("model")


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def _given(mesh: Mesh, name: str) -> bytes:
    """The environment `name` was started with, as the launcher gave it: a service forked
    from a fork server shows that server's first environment in /proc/<pid>/environ (and
    its title overwrites it), so /proc does not tell what a forked process holds."""
    env = {**os.environ, **mesh.supervisor.child(name).launch.env}
    return b"\0".join(f"{key}={value}".encode() for key, value in env.items())


def test_every_path_of_the_state_dir_is_private_but_what_model_servers_read(
    isolated: Mesh,
) -> None:
    root = isolated.state_dir
    identity = mesh_identity(isolated.spec)
    shared = {g.path: g.mode for g in model_grants(root, isolated.paths.resolved_spec, identity, 0)}
    # What every model server reads is its group's (AUTO_GID); what one pool's servers
    # alone hold (their identity) is that pool's group's.
    own = {
        identity.root / name: _pool_user(isolated, name).gid for name in _model_servers(isolated)
    }
    loose: list[str] = []
    for path in [root, *root.rglob("*")]:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            continue
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o007:
            loose.append(f"{path} {mode:04o} (others)")
        elif mode & 0o070:
            owner = next((m for m in own if m == path or m in path.parents), None)
            group = own[owner] if owner is not None else AUTO_GID if path in shared else None
            if info.st_gid != group:
                loose.append(f"{path} {mode:04o} gid {info.st_gid}")
    assert loose == []
    assert shared[root] == 0o710  # the model servers' group passes, never lists


def test_model_servers_run_as_their_own_user_without_privileges(isolated: Mesh) -> None:
    servers = _model_servers(isolated)
    assert servers
    for name, pid in servers.items():
        status = _status(pid)
        user = _pool_user(isolated, name)
        assert user.uid != AUTO_UID  # a pool's own user, not the one every pool shares
        assert status["Uid"].split() == [str(user.uid)] * 4
        assert status["Gid"].split() == [str(user.gid)] * 4
        assert status["Groups"].split() == [str(AUTO_GID)]
        assert status["NoNewPrivs"].strip() == "1"
        assert int(status["CapBnd"], 16) == 0 and int(status["CapEff"], 16) == 0
    # The rest of the mesh stays the launcher's.
    registry = isolated.pid("registry-0")
    assert _status(registry)["Uid"].split()[0] == "0"


def _pool_user(mesh: Mesh, instance: str) -> RunAs:
    """Who a model server runs as: its pool's user."""
    pools = mesh.spec.pool_names()
    return pool_users(RunAs(AUTO_UID, AUTO_GID), pools)[mesh.spec.instance(instance).pool]


def _opens_as_model_user(paths: list[Path], user: RunAs) -> dict[str, str]:
    """Each path opened for reading as a model server's user: "ok" or the error's name."""
    probe = (
        "import sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        open(p, 'rb').close(); print(p, 'ok')\n"
        "    except OSError as e:\n"
        "        print(p, type(e).__name__)\n"
    )
    argv = [
        "setpriv",
        f"--reuid={user.uid}",
        f"--regid={user.gid}",
        f"--groups={','.join(map(str, user.groups))}" if user.groups else "--clear-groups",
        "--",
        sys.executable,
        "-c",
        probe,
        *map(str, paths),
    ]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout
    return dict(line.rsplit(" ", 1) for line in out.splitlines())


def test_the_model_user_cannot_open_the_mesh_secrets(isolated: Mesh) -> None:
    root = isolated.state_dir
    identity = mesh_identity(isolated.spec)
    model = next(iter(_model_servers(isolated)))
    others = [n for n in identity.identities() if n not in _model_servers(isolated)]
    secrets = [
        root / "control-token",
        root / REDIS_PASSWORD_FILE,
        identity.ca_key_file,
        *(identity.leaf(name).key for name in others),
        root / "registry" / "registry.db",
        isolated.logs_dir / "registry-0.log",
    ]
    needed = [
        identity.leaf(model).key,
        identity.leaf(model).cert,
        identity.trust_file,
        isolated.paths.resolved_spec,
    ]
    assert all(p.exists() for p in secrets + needed)
    opened = _opens_as_model_user(secrets + needed, _pool_user(isolated, model))
    assert {p: opened[str(p)] for p in secrets} == {p: "PermissionError" for p in secrets}
    assert {p: opened[str(p)] for p in needed} == {p: "ok" for p in needed}


def test_no_service_holds_the_control_token_and_the_gateway_not_even_its_digest(
    isolated: Mesh,
) -> None:
    token = read_control_token(isolated.state_dir)
    assert token is not None
    for name, pid in isolated.pids().items():
        if name in isolated.spec.metrics_ports or name.split("-")[0] in {
            "registry",
            "model",
            "feature",
            "gateway",
        }:
            seen = _environ(pid) + _given(isolated, name)
            assert token.encode() not in seen + Path(f"/proc/{pid}/cmdline").read_bytes(), name
    for name, pid in isolated.pids_of("gateway").items():
        for seen in (_environ(pid), _given(isolated, name)):
            assert CONTROL_VERIFIER_ENV.encode() not in seen
            assert token_digest(token).encode() not in seen
    for name in _model_servers(isolated):
        assert f"{CONTROL_VERIFIER_ENV}={token_digest(token)}".encode() in _given(isolated, name)


def test_what_a_model_server_holds_opens_no_control_method(isolated: Mesh) -> None:
    token = read_control_token(isolated.state_dir)
    assert token is not None
    digest = token_digest(token)
    with dial_registry(isolated.spec).channel() as channel:
        registry = registry_pb2_grpc.RegistryStub(channel)
        for held in (digest, f"sha256:{digest}"):
            with pytest.raises(grpc.RpcError) as refused:
                registry.CreateModel(
                    pb.CreateModelRequest(name="intruder"),
                    metadata=control_metadata(held),
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_isolated_mesh_still_predicts(isolated: Mesh) -> None:
    with dial_edge(isolated.spec).channel() as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1", "user-2"]),
            timeout=30,
        )
    assert len(reply.scores) == 2
