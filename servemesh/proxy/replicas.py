"""What the mesh's model servers report and what its Envoys see of them: the questions every
change of the fleet asks before it moves on (a scaler's new replica, a rolling update's
renewed one, a new pool an `apply` starts).

- `served_health_names` / `version_health`: whether a replica holds what it serves (its own
  health and each of its pool's versions, SERVING), asked on the replica itself;
- `envoy_hosts`: every Envoy's view of every cluster's hosts (healthy, calls in flight).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.wire import model_cluster, version_health_name
from servemesh.identity import dial_service
from servemesh.proxy.admin import AdminError
from servemesh.proxy.apply import RouteManager
from servemesh.spec import ResolvedSpec

SERVING = health_pb2.HealthCheckResponse.SERVING


def served_health_names(spec: ResolvedSpec, instance: str) -> list[str]:
    """What a model server reports SERVING once it holds what it serves: its own health ("")
    and each version of its pool's models (a pool that loads on demand: its own only, as
    its versions load on their first call)."""
    pool = spec.instance(instance).pool
    settings = spec.pools.get(pool)
    if settings is not None and settings.on_demand:
        return [""]
    return [
        "",
        *(
            version_health_name(model_name, version)
            for model_name in spec.pool_models(pool)
            for version in sorted(spec.models[model_name].versions)
        ),
    ]


def version_health(spec: ResolvedSpec, instance: str, names: list[str]) -> dict[str, bool]:
    """Each health name's status on the replica itself (False: not SERVING or no answer)."""
    found = dict.fromkeys(names, False)
    try:
        with dial_service(spec, instance).channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in names:
                try:
                    answer = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
                except grpc.RpcError:
                    continue
                found[name] = answer.status == SERVING
    except (OSError, ValueError):  # no certificate yet, or no such file: not ready
        pass
    return found


@dataclass(frozen=True)
class HostState:
    healthy: bool
    in_flight: int


def envoy_hosts(manager: RouteManager) -> dict[str, dict[str, HostState]]:
    """The mesh's Envoys' view of every cluster's hosts, by cluster and host:port (a host
    resolved from a name, discovery.backend dns, under name:port too): healthy (health
    checks, EDS status, ejection) and the calls in flight to it (`rq_active`). With
    an Envoy per zone, a cluster more than one holds (the registry's) is healthy where
    every one of them counts the host healthy, its calls in flight summed."""
    views: dict[str, dict[str, HostState]] = {}
    for admin in manager.admins().values():
        for cluster, hosts in _hosts_of(admin.get("/clusters?format=json")).items():
            seen = views.setdefault(cluster, {})
            for address, state in hosts.items():
                before = seen.get(address)
                seen[address] = (
                    state
                    if before is None
                    else HostState(
                        healthy=before.healthy and state.healthy,
                        in_flight=before.in_flight + state.in_flight,
                    )
                )
    return views


def _hosts_of(text: str) -> dict[str, dict[str, HostState]]:
    """One Envoy's /clusters?format=json as host states by cluster and host:port."""
    data = json.loads(text)
    views: dict[str, dict[str, HostState]] = {}
    for status in data.get("cluster_statuses", []):
        hosts: dict[str, HostState] = {}
        named: dict[str, HostState] = {}
        for host in status.get("host_statuses", []):
            socket = host.get("address", {}).get("socket_address")
            if not socket:
                continue
            health = host.get("health_status", {})
            healthy = (
                health.get("eds_health_status", "HEALTHY") == "HEALTHY"
                and not health.get("failed_active_health_check")
                and not health.get("failed_outlier_check")
                and not health.get("pending_active_hc")
            )
            stats = {s.get("name"): s.get("value", 0) for s in host.get("stats", [])}
            state = HostState(healthy=healthy, in_flight=int(stats.get("rq_active", 0) or 0))
            hosts[f"{socket['address']}:{socket['port_value']}"] = state
            # A strict-DNS cluster's host (discovery.backend dns) also answers to the name it
            # was resolved from: healthy while every address of the name is, calls summed.
            name = host.get("hostname")
            if name and name != socket["address"]:
                key = f"{name}:{socket['port_value']}"
                before = named.get(key)
                named[key] = (
                    state
                    if before is None
                    else HostState(
                        healthy=before.healthy and state.healthy,
                        in_flight=before.in_flight + state.in_flight,
                    )
                )
        views[status["name"]] = {**named, **hosts}
    return views


def clusters_listing(spec: ResolvedSpec, instance: str) -> list[str]:
    """Every model-version cluster (of every zone) whose endpoints list `instance`: its
    pool's versions that its set serves."""
    found = []
    for model_name, model in spec.models.items():
        for version in model.versions:
            if instance in {i.name for i in spec.version_replicas(model_name, version)}:
                found += [model_cluster(model_name, version, zone) for zone in spec.zones]
    return found


def wait_model_servers_in(
    manager: RouteManager,
    spec: ResolvedSpec,
    names: list[str],
    timeout_s: float,
    *,
    poll_s: float = 0.2,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """Waits until each model server of `names` holds what it serves (SERVING) and every
    Envoy counts it healthy in its pool's clusters; the names still missing after
    `timeout_s` ([] when all made it)."""
    pending = set(names)
    give_up = clock() + timeout_s
    while pending and clock() <= give_up:
        for name in sorted(pending):
            if all(version_health(spec, name, served_health_names(spec, name)).values()):
                pending.discard(name)
        if not pending:
            break
        sleep(poll_s)
    if pending:
        return sorted(pending)
    listed = {
        name: [(c, "{}:{}".format(*spec.endpoint_of(name))) for c in clusters_listing(spec, name)]
        for name in names
    }
    while True:
        try:
            views = envoy_hosts(manager)
        except (AdminError, OSError, ValueError):
            views = {}
        unhealthy = [
            name
            for name, entries in sorted(listed.items())
            if not all(
                (state := views.get(cluster, {}).get(address)) is not None and state.healthy
                for cluster, address in entries
            )
        ]
        if not unhealthy or clock() > give_up:
            return unhealthy
        sleep(poll_s)
