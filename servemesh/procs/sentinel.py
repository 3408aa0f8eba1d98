"""A Redis Sentinel of our own: watches a replicated store's primary and promotes a replica
when it is down.

`redis-server --sentinel` with a generated, owner-only sentinel.conf in its data dir (it
holds the store's password; Sentinel rewrites the file as it learns the store's shape).
It asks for the same password as the store, talks to the servers and the other Sentinels
with it, and sends the commands a failover needs under the store's secret names
(`replication_renames`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servemesh.contract.atomic import atomic_write_bytes
from servemesh.contract.private import private_dir
from servemesh.procs.ready import RedisPing
from servemesh.procs.redis_server import (
    _quote,
    ensure_redis_password,
    redis_server_binary,
    replication_renames,
)
from servemesh.procs.supervisor import ProcessError, Supervisor
from servemesh.spec import SENTINEL_MASTER_NAME as MASTER_NAME
from servemesh.spec import free_port


def quorum_of(sentinels: int) -> int:
    """Sentinels that must agree the primary is down: a majority of them (a failover needs
    a majority's vote anyway, so a smaller quorum only starts elections that cannot win)."""
    return sentinels // 2 + 1


@dataclass
class SentinelServer:
    """One Sentinel child of `supervisor`, watching the primary at `primary` ("host port")."""

    supervisor: Supervisor
    data_dir: Path
    primary: str
    password_file: Path
    quorum: int
    down_after_ms: int
    failover_timeout_ms: int
    host: str = "127.0.0.1"
    port: int = 0
    name: str = "redis-sentinel"
    group: str = "redis"

    @property
    def url(self) -> str:
        if not self.port:
            raise ProcessError(f"{self.name} has no port until it is started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "sentinel.conf"

    @property
    def pid(self) -> int:
        return self.supervisor.pid(self.name)

    def config_lines(self) -> list[str]:
        """The Sentinel's sentinel.conf (it holds the password)."""
        password = ensure_redis_password(self.password_file)
        watched = f"sentinel monitor {MASTER_NAME} {self.primary} {self.quorum}"
        return [
            f"port {self.port}",
            f"bind {self.host}",
            "protected-mode yes",
            f"dir {_quote(str(self.data_dir))}",
            f"requirepass {_quote(password)}",
            # The other Sentinels ask for the same password.
            f"sentinel sentinel-pass {_quote(password)}",
            watched,
            f"sentinel auth-pass {MASTER_NAME} {_quote(password)}",
            f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}",
            f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {MASTER_NAME} 1",
            *(
                f"sentinel rename-command {MASTER_NAME} {command} {renamed}"
                for command, renamed in replication_renames(password).items()
            ),
            # No scripts run on an event, and no client may change that.
            "sentinel deny-scripts-reconfig yes",
        ]

    def start(self, timeout_s: float = 15.0) -> int:
        """Start the Sentinel and wait until it answers PING; returns its PID."""
        if self.supervisor.is_running(self.name):
            return self.pid
        if self.name in self.supervisor.children:
            return self.supervisor.restart(self.name, timeout_s).pid
        if not self.port:
            self.port = free_port(self.host)
        private_dir(self.data_dir)
        text = "\n".join(self.config_lines()) + "\n"
        atomic_write_bytes(self.config_path, text.encode(), 0o600)
        argv = [redis_server_binary(), str(self.config_path), "--sentinel"]
        password = ensure_redis_password(self.password_file)
        ready = RedisPing(self.url, password=password)
        return self.supervisor.start(
            self.name, argv, group=self.group, ready=ready, timeout_s=timeout_s
        ).pid
