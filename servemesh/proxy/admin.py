"""Envoy's admin API, read as data: what config it serves, host health, counters, runtime."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any


class AdminError(RuntimeError):
    """Envoy's admin API did not answer as expected."""


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
    counters: dict[str, int] = field(default_factory=dict)

    def healthy_by_zone(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for host in self.hosts:
            counts.setdefault(host.zone, 0)
            if host.healthy:
                counts[host.zone] += 1
        return counts


class AdminClient:
    def __init__(self, address: str, timeout_s: float = 2.0) -> None:
        self.address = address
        self.timeout_s = timeout_s

    def get(self, path: str) -> str:
        try:
            with urllib.request.urlopen(
                f"http://{self.address}{path}", timeout=self.timeout_s
            ) as reply:
                return reply.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            raise AdminError(
                f"Envoy admin at {self.address} did not answer {path}: {exc}"
            ) from None

    def post(self, path: str) -> str:
        request = urllib.request.Request(f"http://{self.address}{path}", method="POST", data=b"")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            raise AdminError(f"Envoy admin at {self.address} refused {path}: {exc}") from None

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
                socket = host["address"]["socket_address"]
                health = host.get("health_status", {})
                ejected = bool(health.get("failed_outlier_check"))
                failed_check = bool(health.get("failed_active_health_check"))
                view.hosts.append(
                    HostHealth(
                        address=f"{socket['address']}:{socket['port_value']}",
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
        """Set runtime keys (admin layer), e.g. fault percentages for a drill."""
        self.post(
            "/runtime_modify?" + urllib.parse.urlencode({k: str(v) for k, v in values.items()})
        )

    def runtime(self) -> dict[str, str]:
        data = json.loads(self.get("/runtime"))
        return {k: str(v.get("final_value", "")) for k, v in data.get("entries", {}).items()}
