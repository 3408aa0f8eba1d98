"""The mesh's own Redis is locked: a password only the state dir holds, loopback only,
and the commands that could wipe or reconfigure it gone. Checked on the session mesh."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import redis

from servemesh.launcher import Mesh
from servemesh.procs.redis_server import DISABLED_COMMANDS

SWEPT_SUFFIXES = {".json", ".yaml", ".yml", ".log", ".txt", ""}


def plain_client(mesh: Mesh, password: str | None = None) -> redis.Redis:
    return redis.Redis.from_url(
        mesh.spec.redis_url, password=password, socket_connect_timeout=2, socket_timeout=2
    )


def test_a_client_without_the_password_is_refused(mesh: Mesh) -> None:
    client = plain_client(mesh)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            client.get("anything")
    finally:
        client.close()
    wrong = plain_client(mesh, password="not-the-password")
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            wrong.ping()
    finally:
        wrong.close()


def test_the_password_file_is_owner_only_and_opens_the_store(mesh: Mesh) -> None:
    path = Path(str(mesh.spec.feature_store.password_file))
    assert path.parent == mesh.state_dir
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    client = plain_client(mesh, mesh.spec.redis_password())
    try:
        assert client.ping()
        assert client.dbsize() > 0  # the demo rows the feature services read
    finally:
        client.close()


@pytest.mark.parametrize("command", ["FLUSHALL", "FLUSHDB", "CONFIG", "KEYS", "DEBUG"])
def test_dangerous_commands_are_refused_even_with_the_password(mesh: Mesh, command: str) -> None:
    assert command in DISABLED_COMMANDS
    args = {"CONFIG": ("GET", "requirepass"), "KEYS": ("*",), "DEBUG": ("SLEEP", "0")}
    client = plain_client(mesh, mesh.spec.redis_password())
    try:
        with pytest.raises(redis.exceptions.ResponseError, match="unknown command"):
            client.execute_command(command, *args.get(command, ()))
        assert client.dbsize() > 0  # nothing was wiped
    finally:
        client.close()


def test_the_password_is_in_no_log_or_printed_file(mesh: Mesh) -> None:
    password = mesh.spec.redis_password()
    assert password
    endpoints = json.loads(mesh.endpoints_path.read_text())
    assert password not in endpoints["redis"] and "@" not in endpoints["redis"]
    assert password not in mesh.resolved_spec_path.read_text()
    secret_files = {
        Path(str(mesh.spec.feature_store.password_file)),
        mesh.state_dir / "redis" / "redis.conf",  # the server's own config, owner-only
    }
    conf = mesh.state_dir / "redis" / "redis.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    swept = 0
    for path in mesh.state_dir.rglob("*"):
        if not path.is_file() or path in secret_files or path.suffix not in SWEPT_SUFFIXES:
            continue
        swept += 1
        assert password not in path.read_text(errors="replace"), f"{path} holds the password"
    assert swept > 5  # the logs, endpoints.json, the resolved spec, the xDS files


def _listening(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port` (from /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_redis_listens_on_loopback_only(mesh: Mesh) -> None:
    port = mesh.spec.embedded_redis_port
    assert port is not None
    # 0100007F is 127.0.0.1 in the kernel's byte order; no IPv6 or wildcard listener.
    assert _listening(port) == {"0100007F"}
