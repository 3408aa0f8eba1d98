"""A throwaway PostgreSQL server for the tests: `initdb` into a temp dir, `postgres` on a
free loopback port, stopped by PID.

The prediction log's PostgreSQL store is tested against a real server, started here the
way the tests start Redis, so a fresh machine with Debian's `postgresql` package installed
needs nothing running. PostgreSQL refuses to run as root: as root, the cluster belongs to
the `postgres` user the package creates, and both programs run as that user (setpriv).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psycopg

from servemesh.procs import Supervisor
from servemesh.procs.ready import Check
from servemesh.spec import free_port

DATABASE = "test"


class PostgresUnavailable(RuntimeError):
    """The machine has no PostgreSQL server binaries (or no user to run them as)."""


def _bindir() -> Path:
    """Where initdb and postgres live: pg_config's answer, else Debian's versioned dirs."""
    if (pg_config := shutil.which("pg_config")) is not None:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        candidate = Path(out.stdout.strip())
        if (candidate / "postgres").exists():
            return candidate
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), reverse=True)
    if found:
        return Path(found[0]).parent
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (postgres, initdb): install Debian's postgresql package"
    )


def _run_as() -> list[str]:
    """The argv prefix that runs a PostgreSQL program as a user it accepts."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresUnavailable(
            "running as root and no `postgres` user to run PostgreSQL as "
            "(Debian's postgresql package creates it)"
        ) from None
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise PostgresUnavailable("running as root and no setpriv to run PostgreSQL as postgres")
    return [setpriv, "--reuid=postgres", "--regid=postgres", "--init-groups", "--"]


@dataclass
class PostgresServer:
    """One `postgres` child of `supervisor` with its cluster in `root` (trust auth on
    loopback, no Unix socket outside `root`), and a database named `test`.

    As root, `root` must be reachable by the `postgres` user: make it with
    tempfile.mkdtemp() (under /tmp), not under pytest's private temp folders."""

    supervisor: Supervisor
    root: Path
    host: str = "127.0.0.1"
    port: int = 0
    name: str = "postgres"

    def dsn(self, database: str = DATABASE) -> str:
        return (
            f"host={self.host} port={self.port} dbname={database} user=postgres connect_timeout=5"
        )

    def start(self, timeout_s: float = 60.0) -> None:
        bindir = _bindir()
        prefix = _run_as()
        data = self.root / "data"
        sockets = self.root / "sockets"
        for folder in (self.root, sockets):
            folder.mkdir(parents=True, exist_ok=True)
        if prefix:
            # The cluster's owner must reach its folders; the temp dirs above belong to root.
            postgres_user = pwd.getpwnam("postgres")
            for folder in (self.root, sockets):
                os.chown(folder, postgres_user.pw_uid, postgres_user.pw_gid)
        initdb = subprocess.run(
            [
                *prefix,
                str(bindir / "initdb"),
                "--pgdata",
                str(data),
                "--auth=trust",
                "--username=postgres",
                "--encoding=UTF8",
                "--no-sync",
            ],
            capture_output=True,
            text=True,
        )
        if initdb.returncode != 0:
            raise PostgresUnavailable(f"initdb failed: {initdb.stderr.strip()[-500:]}")
        self.port = free_port(self.host)
        argv = [
            *prefix,
            str(bindir / "postgres"),
            "-D",
            str(data),
            "-p",
            str(self.port),
            "-c",
            f"listen_addresses={self.host}",
            "-c",
            f"unix_socket_directories={sockets}",
            "-c",
            "fsync=off",
        ]
        self.supervisor.start(
            self.name,
            argv,
            ready=Check(self._answers, f"PostgreSQL on {self.host}:{self.port}"),
            timeout_s=timeout_s,
        )
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")

    def _answers(self) -> bool:
        try:
            with psycopg.connect(
                self.dsn("postgres").replace("connect_timeout=5", "connect_timeout=1")
            ):
                return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        if self.name in self.supervisor.children:
            self.supervisor.stop(self.name)
