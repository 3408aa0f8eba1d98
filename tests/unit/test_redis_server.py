"""The Redis the launcher runs: a Redis 7 from PATH when there is one, a password that is
owner-only on disk and absent from its command line, refused without it."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest
import redis

from servemesh.procs import RedisServer, Supervisor
from servemesh.procs.redis_server import _major_version, redis_server_binary


def test_a_redis_7_on_path_is_preferred() -> None:
    found = shutil.which("redis-server")
    if found is None or (_major_version(found) or 0) < 7:
        pytest.skip("no Redis 7 redis-server on PATH")
    assert redis_server_binary() == found


def test_the_password_is_owner_only_off_the_command_line_and_required(tmp_path: Path) -> None:
    password_file = tmp_path / "state" / "redis-password"
    with Supervisor(tmp_path / "logs") as sup:
        server = RedisServer(sup, tmp_path / "data", password_file=password_file)
        pid = server.start()
        password = password_file.read_text().strip()
        assert len(password) >= 32
        for path in (password_file, server.config_path):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert password not in cmdline
        anonymous = redis.Redis(host=server.host, port=server.port, socket_timeout=2)
        try:
            with pytest.raises(redis.exceptions.AuthenticationError):
                anonymous.set("k", "v")
        finally:
            anonymous.close()
        client = server.client()
        try:
            client.set("k", "v")
            with pytest.raises(redis.exceptions.ResponseError, match="unknown command"):
                client.execute_command("FLUSHALL")
            assert client.get("k") == b"v"
        finally:
            client.close()
        # A restart keeps the password (the services hold it from the file).
        server.outage()
        server.start()
        assert password_file.read_text().strip() == password
        log = (tmp_path / "logs" / "redis.log").read_text(errors="replace")
        assert "Ready to accept connections" in log and password not in log
