"""Fixtures shared by every test: real processes on loopback, stopped by PID."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.procs import RedisServer, Supervisor
from tests.postgres_server import PostgresServer


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of our own on a free loopback port, for the whole session.

    Its URL carries the password (a spec-given external URL may): the tests' clients and
    feature services connect with it as they are."""
    root = tmp_path_factory.mktemp("redis")
    with Supervisor(root / "logs") as supervisor:
        # Keyspace events for the tests that watch a load's keys (CONFIG SET is disabled).
        server = RedisServer(supervisor, root / "data", settings=('notify-keyspace-events "K$g"',))
        server.start(timeout_s=10)
        yield f"redis://:{server.password}@{server.host}:{server.port}/0"


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL of our own (initdb in a temp dir, a free loopback port) for the
    whole session, with an empty database `test`; stopped by PID, its files removed."""
    root = Path(tempfile.mkdtemp(prefix="servemesh-postgres-"))
    root.chmod(0o711)  # as root, the cluster runs as `postgres`, who must pass through
    try:
        with Supervisor(root / "logs") as supervisor:
            server = PostgresServer(supervisor, root / "cluster")
            server.start()
            yield server
    finally:
        shutil.rmtree(root, ignore_errors=True)
