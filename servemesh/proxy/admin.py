"""Envoy's admin API, read as data: what config it serves, host health, counters, runtime.

The admin API can stop Envoy, drain its listeners and rewrite its runtime, so it is not on
the network: Envoy serves it on a Unix socket in a directory only the mesh's user may enter
(`admin_socket_path`), and this client speaks HTTP over that socket.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servemesh.contract.errors import ServemeshError
from servemesh.spec import EDGE_PROXY, is_edge_proxy, proxy_part

# Linux's limit on a Unix socket path (sun_path holds 108 bytes, one for the NUL).
_MAX_SOCKET_PATH = 107
# Envoy creates the socket with this mode; the directory's 0700 is what keeps others out.
ADMIN_SOCKET_MODE = 0o600


class AdminError(ServemeshError, RuntimeError):
    """Envoy's admin API did not answer as expected."""


def admin_dir(state_dir: Path | str) -> Path:
    """The directory of a mesh's admin socket: mode 0700, so only its owner can connect."""
    return Path(state_dir) / "admin"


def admin_socket_path(state_dir: Path | str, proxy: str = EDGE_PROXY) -> Path:
    """Where an Envoy of the mesh with this state dir serves its admin API: the first zone's
    edge's (the only one in the shared layout) at admin/envoy.sock, a zone's at
    admin/envoy-<zone>.sock, another zone's edge's at admin/edge-<zone>.sock (no longer
    than its zone's: a socket's path has a short limit)."""
    zone_edge = is_edge_proxy(proxy) and proxy != EDGE_PROXY
    name = f"{proxy}.sock" if zone_edge else f"{proxy_part(proxy)}.sock"
    path = admin_dir(state_dir) / name
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise ValueError(
            f"state_dir: {state_dir} is too long for Envoy's admin socket "
            f"({path} is over {_MAX_SOCKET_PATH} bytes); choose a shorter state dir"
        )
    return path


def prepare_admin_dir(state_dir: Path | str, proxy: str = EDGE_PROXY) -> Path:
    """Create the admin socket's directory (0700, even if it existed with another mode) and
    remove a socket a previous Envoy left; the socket's path."""
    path = admin_socket_path(state_dir, proxy)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    path.unlink(missing_ok=True)
    return path


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 to a server listening on a Unix socket."""

    def __init__(self, socket_path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def admin_request(socket_path: Path | str, method: str, path: str, timeout_s: float) -> str:
    """One request to Envoy's admin API on its Unix socket; the body of a 2xx answer.
    Raises OSError (no socket, refused, timeout) or AdminError (any other status)."""
    connection = _UnixHTTPConnection(str(socket_path), timeout_s)
    try:
        connection.request(method, path, body=b"" if method == "POST" else None)
        reply = connection.getresponse()
        body = reply.read().decode()
    except http.client.HTTPException as exc:
        raise OSError(str(exc)) from None
    finally:
        connection.close()
    if not 200 <= reply.status < 300:
        raise AdminError(f"HTTP {reply.status}: {body.strip()[:200]}")
    return body


@dataclass(frozen=True)
class ServedVersions:
    routes: dict[str, str]
    clusters: dict[str, str]


@dataclass
class HostHealth:
    address: str
    zone: str
    priority: int
    healthy: bool
    ejected: bool
    failed_health_check: bool


@dataclass
class ClusterView:
    name: str
    hosts: list[HostHealth] = field(default_factory=list)

    def healthy_by_zone(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for host in self.hosts:
            counts.setdefault(host.zone, 0)
            if host.healthy:
                counts[host.zone] += 1
        return counts


class AdminClient:
    """Envoy's admin API on its Unix socket (`admin_socket_path`, `endpoints.json`'s
    `envoy_admin`)."""

    def __init__(self, socket_path: Path | str, timeout_s: float = 2.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout_s = timeout_s

    @property
    def address(self) -> str:
        """Where the API is, for people: `unix:<socket path>`."""
        return f"unix:{self.socket_path}"

    @classmethod
    def of_mesh(cls, state_dir: Path | str, timeout_s: float = 2.0) -> AdminClient:
        """The admin API of the mesh running from `state_dir`."""
        return cls(admin_socket_path(state_dir), timeout_s)

    def _call(self, method: str, path: str) -> str:
        try:
            return admin_request(self.socket_path, method, path, self.timeout_s)
        except (AdminError, OSError) as exc:
            verb = "did not answer" if method == "GET" else "refused"
            raise AdminError(
                f"Envoy admin at {self.socket_path} {verb} {path.partition('?')[0]}: {exc}"
            ) from None

    def get(self, path: str) -> str:
        return self._call("GET", path)

    def post(self, path: str) -> str:
        return self._call("POST", path)

    def is_ready(self) -> bool:
        """Envoy is up and finished its first round of initialisation (health checks)."""
        try:
            return admin_request(self.socket_path, "GET", "/ready", 0.5).strip() == "LIVE"
        except (AdminError, OSError):
            return False

    def config_dump(self, resource: str) -> list[dict[str, Any]]:
        return list(json.loads(self.get(f"/config_dump?resource={resource}")).get("configs", []))

    def served_versions(self) -> ServedVersions:
        routes = {
            c["route_config"]["name"]: c.get("version_info", "")
            for c in self.config_dump("dynamic_route_configs")
            if "route_config" in c
        }
        clusters = {
            c["cluster"]["name"]: c.get("version_info", "")
            for c in self.config_dump("dynamic_active_clusters")
            if "cluster" in c
        }
        return ServedVersions(routes=routes, clusters=clusters)

    def route_configs(self) -> dict[str, dict[str, Any]]:
        return {
            c["route_config"]["name"]: c["route_config"]
            for c in self.config_dump("dynamic_route_configs")
            if "route_config" in c
        }

    def counters(self, prefix: str = "cluster.") -> dict[str, int]:
        """Counters and gauges whose name starts with prefix."""
        text = self.get("/stats?filter=" + urllib.parse.quote("^" + prefix.replace(".", "\\.")))
        values: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                values[name] = int(value)
        return values

    def clusters(self) -> dict[str, ClusterView]:
        data = json.loads(self.get("/clusters?format=json"))
        views: dict[str, ClusterView] = {}
        for status in data.get("cluster_statuses", []):
            view = ClusterView(name=status["name"])
            for host in status.get("host_statuses", []):
                where = host["address"]
                # A Unix socket (the stats listener's route to the admin API) has a path.
                socket = where.get("socket_address")
                address = (
                    f"{socket['address']}:{socket['port_value']}"
                    if socket
                    else str(where.get("pipe", {}).get("path", ""))
                )
                health = host.get("health_status", {})
                ejected = bool(health.get("failed_outlier_check"))
                failed_check = bool(health.get("failed_active_health_check"))
                view.hosts.append(
                    HostHealth(
                        address=address,
                        zone=host.get("locality", {}).get("zone", ""),
                        priority=int(host.get("priority", 0)),
                        healthy=health.get("eds_health_status", "HEALTHY") == "HEALTHY"
                        and not ejected
                        and not failed_check,
                        ejected=ejected,
                        failed_health_check=failed_check,
                    )
                )
            views[view.name] = view
        return views

    def set_runtime(self, values: dict[str, str | int | float]) -> None:
        """Set runtime keys (admin layer), e.g. fault percentages for a drill. Only a mesh
        whose spec has `traffic.runtime_overrides: true` has that layer; any other Envoy
        refuses, and this raises AdminError."""
        self.post(
            "/runtime_modify?" + urllib.parse.urlencode({k: str(v) for k, v in values.items()})
        )

    def runtime(self) -> dict[str, str]:
        data = json.loads(self.get("/runtime"))
        return {k: str(v.get("final_value", "")) for k, v in data.get("entries", {}).items()}
