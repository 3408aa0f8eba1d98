"""What Envoy is serving right now, per model version, read from its admin API: the weight,
the sticky bucket range, health per zone, and each version's (arm's) traffic counters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from servemesh.contract.wire import (
    BUCKET_HEADER,
    MODEL_INFER_STAT,
    mesh_route_config,
    model_cluster,
)
from servemesh.proxy.admin import AdminClient, ClusterView
from servemesh.spec import MeshSpec

INFER_STATS = f"grpc.{MODEL_INFER_STAT}"


@dataclass
class VersionView:
    model: str
    version: str
    weight: int
    shadow: bool
    healthy: dict[str, int] = field(default_factory=dict)
    hosts: dict[str, int] = field(default_factory=dict)
    # The sticky buckets [start, end) of 0..wire.BUCKETS Envoy routes to this version
    # (calls that carry the gateway's bucket header); None: no range (weight 0).
    buckets: tuple[int, int] | None = None
    requests: int = 0
    errors: int = 0
    retries: int = 0
    ejections: int = 0
    overflows: int = 0
    # The model's route policy: a try's timeout (0: none), and whether a try past it is
    # hedged (another try sent beside it, the first answer winning).
    per_try_timeout_ms: int = 0
    hedging: bool = False
    # Retried calls that were answered in the end (with hedging, `retries` counts the
    # hedges sent too, and a hedged call answered by either try counts here).
    retry_successes: int = 0


def served_split(
    admin: AdminClient, spec: MeshSpec, zone: str
) -> dict[str, tuple[dict[str, int], str | None]]:
    """Per model: the weights and shadow version in the route config Envoy serves for `zone`."""
    config = admin.route_configs().get(mesh_route_config(zone))
    if config is None:
        return {}
    split: dict[str, tuple[dict[str, int], str | None]] = {}
    for route in config["virtual_hosts"][0]["routes"]:
        name = route.get("name", "")
        if not name.endswith("-split"):
            continue
        model = name.removesuffix("-split")
        model_spec = spec.models.get(model)
        if model_spec is None:
            continue
        by_cluster = {model_cluster(model, v, zone): v for v in model_spec.versions}
        action = route["route"]
        weights = {
            by_cluster[entry["name"]]: int(entry.get("weight", 0))
            for entry in action["weighted_clusters"]["clusters"]
            if entry["name"] in by_cluster
        }
        mirrors = action.get("request_mirror_policies", [])
        shadow = next(
            (by_cluster[m["cluster"]] for m in mirrors if m["cluster"] in by_cluster), None
        )
        split[model] = (weights, shadow)
    return split


def served_buckets(
    admin: AdminClient, spec: MeshSpec, zone: str
) -> dict[tuple[str, str], tuple[int, int]]:
    """Per (model, version): the bucket range of its sticky route in the route config Envoy
    serves for `zone` (routes that match the bucket header by range)."""
    config = admin.route_configs().get(mesh_route_config(zone))
    if config is None:
        return {}
    clusters = {
        model_cluster(m, v, zone): (m, v)
        for m, model in spec.models.items()
        for v in model.versions
    }
    found: dict[tuple[str, str], tuple[int, int]] = {}
    for route in config["virtual_hosts"][0]["routes"]:
        arm = clusters.get(route.get("route", {}).get("cluster", ""))
        for header in route.get("match", {}).get("headers", []):
            if arm is not None and header.get("name") == BUCKET_HEADER and "range_match" in header:
                bounds = header["range_match"]
                # Envoy's config dump writes int64 fields as strings.
                found[arm] = (int(bounds.get("start", 0)), int(bounds["end"]))
    return found


def live_view(admins: Mapping[str, AdminClient], spec: MeshSpec) -> list[VersionView]:
    """One row per model version: served weight, healthy hosts per zone, traffic counters.

    `admins` is every Envoy of the mesh by name (spec.proxies(): RouteManager.admins). The
    split and health are the first zone's Envoy's; the counters add up every zone's cluster
    of the version (each zone's callers have their own), from every Envoy.
    """
    first = admins[spec.proxy_of_zone(spec.zones[0])]
    clusters = first.clusters()
    counters: dict[str, int] = {}
    for one in admins.values():
        for name, value in one.counters("cluster.model-").items():
            counters[name] = counters.get(name, 0) + value
    split = served_split(first, spec, spec.zones[0])
    buckets = served_buckets(first, spec, spec.zones[0])
    rows = []
    for model_name, model in sorted(spec.models.items()):
        weights, shadow = split.get(model_name, ({}, None))
        for version in sorted(model.versions):
            row = VersionView(model_name, version, weights.get(version, 0), shadow == version)
            row.buckets = buckets.get((model_name, version))
            retries = (model.policy or spec.traffic.model).retries
            row.per_try_timeout_ms = retries.per_try_timeout_ms
            row.hedging = retries.hedge_on_per_try_timeout
            for zone in spec.zones:
                name = model_cluster(model_name, version, zone)
                _add_counters(row, name, counters)
                if zone == spec.zones[0]:
                    _add_health(row, clusters.get(name))
            rows.append(row)
    return rows


def _add_health(row: VersionView, cluster: ClusterView | None) -> None:
    if cluster is None:
        return
    for host in cluster.hosts:
        row.hosts[host.zone] = row.hosts.get(host.zone, 0) + 1
        row.healthy[host.zone] = row.healthy.get(host.zone, 0) + int(host.healthy)


def _add_counters(row: VersionView, cluster: str, counters: dict[str, int]) -> None:
    def get(stat: str) -> int:
        return counters.get(f"cluster.{cluster}.{stat}", 0)

    row.requests += get(f"{INFER_STATS}.total")
    row.errors += get(f"{INFER_STATS}.failure")
    row.retries += get("upstream_rq_retry")
    row.retry_successes += get("upstream_rq_retry_success")
    row.ejections += get("outlier_detection.ejections_enforced_total")
    row.overflows += sum(
        get(stat)
        for stat in (
            "upstream_rq_active_overflow",
            "upstream_rq_pending_overflow",
            "upstream_rq_retry_overflow",
            "upstream_cx_overflow",
        )
    )
