"""Chaos Toolkit probes: what callers see (from the drill's background load), what Envoy
sees (admin stats), and whether each service and Redis answer.

Percentages are numbers from 0 to 100, latencies milliseconds, so an experiment's
tolerances read like the SLO they state: `tolerance: [99.5, 100]`.

Load probes take a `scope`:

| scope | calls counted |
| --- | --- |
| `last` | sent in the last `window_s` seconds (ending half a second ago, so they have answered) |
| `faults` | sent while a fault window was open; before any fault, every call (the baseline) |
| `drill` | every call since the load started |
| `after-faults` | sent after the last fault window closed; before any fault, every call |
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.chaos.drill import current
from servemesh.chaos.errors import DrillError
from servemesh.chaos.report import drill_recovery, envoy_deltas
from servemesh.contract.control_credential import control_metadata_for
from servemesh.contract.wire import (
    GATEWAY_CLUSTER,
    feature_cluster,
    is_shadow_cluster,
    model_cluster,
    zone_of_cluster,
)
from servemesh.identity import Dial, dial_registry_mirror, dial_service
from servemesh.load import WindowStats, window_stats
from servemesh.proxy.admin import AdminError
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

__all__ = [
    "success_rate",
    "degraded_rate",
    "latency_ms",
    "zone_share",
    "min_zone_share",
    "version_share",
    "window",
    "observe",
    "envoy_stats",
    "healthy_hosts",
    "wait_healthy_hosts",
    "services_healthy",
    "redis_reachable",
    "try_model_load",
    "model_load_fails_cleanly",
    "p99_against_baseline",
]

SETTLE_S = 0.5
# How often a recovery watch reads the numbers so far, and a health wait Envoy's view.
RECOVERY_POLL_S = 1.0
HEALTH_POLL_S = 0.25


def _stats(scope: str = "last", window_s: float = 5.0) -> WindowStats:
    drill = current()
    load = drill.load
    if load is None:
        raise DrillError("the drill's load is not running")
    now = drill.now_s()
    outcomes = list(load.outcomes)
    if scope == "last":
        end = max(0.0, now - SETTLE_S)
        return window_stats(outcomes, max(0.0, end - float(window_s)), end)
    if scope == "drill":
        return window_stats(outcomes, 0.0, now)
    if scope == "faults":
        stats = drill.fault_stats()
        return stats if stats is not None else window_stats(outcomes, 0.0, now)
    if scope == "after-faults":
        ends = [w.end_s for w in drill.windows if w.end_s is not None]
        if drill.windows and len(ends) == len(drill.windows):
            return window_stats(outcomes, max(ends), now)
        return window_stats(outcomes, 0.0, now)
    raise DrillError(f"scope {scope!r}: one of last, faults, drill, after-faults")


def _number(value: float) -> float:
    # No calls in the window: 0, so a tolerance fails loudly instead of comparing NaN.
    return 0.0 if value != value else round(value, 3)


# --- what callers see ------------------------------------------------------------------------


def success_rate(scope: str = "last", window_s: float = 5.0) -> float:
    """% of Predict calls answered (a degraded fallback counts as an answer)."""
    return _number(_stats(scope, window_s).success_pct)


def degraded_rate(scope: str = "last", window_s: float = 5.0) -> float:
    """% of answers that were degraded fallbacks."""
    stats = _stats(scope, window_s)
    return 0.0 if stats.ok == 0 else _number(stats.degraded_pct)


def latency_ms(percentile: float = 99, scope: str = "last", window_s: float = 5.0) -> float:
    """p50 or p99 (ms) of answered calls."""
    stats = _stats(scope, window_s)
    if percentile == 50:
        return _number(stats.p50_ms)
    if percentile == 99:
        return _number(stats.p99_ms)
    raise DrillError("latency_ms: percentile 50 or 99")


def zone_share(zone: str, scope: str = "last", window_s: float = 5.0) -> float:
    """% of (non-degraded) answers a model replica of `zone` computed."""
    return round(_stats(scope, window_s).zones.get(zone, 0.0), 3)


def min_zone_share(scope: str = "last", window_s: float = 5.0) -> float:
    """The smallest zone's % of answers: every zone serves when this is well above 0."""
    stats = _stats(scope, window_s)
    return round(min(stats.zones.get(z, 0.0) for z in current().spec.zones), 3)


def version_share(version: str, scope: str = "last", window_s: float = 5.0) -> float:
    """% of answers computed by `version`."""
    return round(_stats(scope, window_s).versions.get(version, 0.0), 3)


def p99_against_baseline() -> dict[str, Any]:
    """p99 in the fault windows over the baseline's (the load before the first fault):
    what a slow zone costs callers. Marked on the timeline."""
    drill = current()
    load = drill.load
    if load is None or not drill.windows:
        raise DrillError("p99_against_baseline: needs the load and a fault window")
    baseline = window_stats(list(load.outcomes), 0.0, drill.windows[0].start_s)
    faults = _stats("faults")
    ratio = faults.p99_ms / baseline.p99_ms if baseline.p99_ms else float("nan")
    found = {
        "baseline_p99_ms": _number(baseline.p99_ms),
        "fault_p99_ms": _number(faults.p99_ms),
        "ratio": _number(ratio),
    }
    drill.timeline.mark(
        f"p99 in the fault window {found['fault_p99_ms']:g} ms = {found['ratio']:g}x the "
        f"baseline's {found['baseline_p99_ms']:g} ms"
    )
    return found


def window(scope: str = "last", window_s: float = 5.0) -> dict[str, Any]:
    """Every number of a window: calls, failures by status, latency, zones, versions."""
    return _stats(scope, window_s).as_dict()


def observe(seconds: float, label: str = "", until_recovered: bool = False) -> dict[str, Any]:
    """Keep the fault in place for `seconds` while the load runs, then report that period.

    This is how a drill holds a fault: unlike a pause, the guard can cut it short. With
    `until_recovered` (a recovery watch, after the faults), `seconds` is the longest it
    watches: it ends as soon as the report's recovery numbers are in, the SLO met and every
    zone back for a whole recovery window. A quick recovery then costs no fixed wait, and a
    slow one (a busy machine restarting a replica) is still watched to its end.
    """
    drill = current()
    start = drill.now_s()
    if until_recovered:
        completed, recovered = _watch_recovery(start + float(seconds))
    else:
        completed, recovered = drill.sleep(float(seconds)), None
    end = drill.now_s()
    # Give calls sent at the end of the period time to answer before reading it.
    time.sleep(min(SETTLE_S, float(seconds)))
    assert drill.load is not None
    stats = drill.load.window(start, end).as_dict()
    stats["label"] = label
    stats["interrupted"] = not completed
    if recovered is not None:
        stats["recovered"] = recovered
    return stats


def _watch_recovery(until_s: float) -> tuple[bool, bool]:
    """Wait until the drill's calls so far show a recovery, or until `until_s`.

    Returns (not cut short by the guard, recovered). Calls of the last SETTLE_S may still be
    in flight, so the numbers are read up to that moment only.
    """
    drill = current()
    assert drill.load is not None
    while True:
        if not drill.sleep(RECOVERY_POLL_S):
            return False, False
        now = drill.now_s()
        settled = now - SETTLE_S
        sent = [o for o in drill.load.snapshot() if o.sent_s < settled]
        so_far = drill_recovery(drill, sent, settled)
        if so_far.time_to_recover_s is not None and so_far.zones_back_s is not None:
            return True, True
        if now >= until_s:
            return True, False


# --- what Envoy sees -------------------------------------------------------------------------


def envoy_stats() -> dict[str, Any]:
    """Retries, outlier ejections, overflows since the drill began (by kind of cluster,
    summed over every Envoy), and healthy hosts per locality as the first zone's clusters
    (and the edge's gateways) see them now."""
    drill = current()
    assert drill.admin is not None
    first = drill.spec.zones[0]
    try:
        counters = drill.counters()
        clusters = {**drill.admin_of_zone(first).clusters(), **drill.admin.clusters()}
    except AdminError as exc:
        return {"error": str(exc)}
    delta = envoy_deltas(drill.counters_start, counters)
    healthy: dict[str, dict[str, str]] = {}
    for cluster_name, view in sorted(clusters.items()):
        if zone_of_cluster(cluster_name) != first and cluster_name != GATEWAY_CLUSTER:
            continue
        if is_shadow_cluster(cluster_name):
            continue
        totals: dict[str, int] = {}
        for host in view.hosts:
            totals[host.zone] = totals.get(host.zone, 0) + 1
        good = view.healthy_by_zone()
        healthy[cluster_name] = {z: f"{good.get(z, 0)}/{n}" for z, n in sorted(totals.items())}
    return {**delta, "healthy": healthy}


def edge_calls() -> dict[str, int]:
    """Calls each edge Envoy has taken since it (last) started, by Envoy name: after one was
    killed and started again, a count above 0 says callers came back to it."""
    drill = current()
    taken: dict[str, int] = {}
    for proxy in drill.spec.edge_proxies():
        try:
            counters = drill.admin_of_proxy(proxy).counters("http.edge.downstream_rq_total")
        except AdminError as exc:
            raise DrillError(f"{proxy}'s Envoy does not answer: {exc}") from None
        taken[proxy] = int(counters.get("http.edge.downstream_rq_total", 0))
    return taken


def healthy_hosts(service: str = "model", zone: str | None = None, via: str | None = None) -> int:
    """Hosts of `service` Envoy holds healthy (in `zone`, or all), as seen from `via`'s
    clusters (default: the first zone). For models, the first version's cluster."""
    drill = current()
    spec = drill.spec
    via = via or spec.zones[0]
    if service == "model":
        model = str(drill.config["model"])
        version = sorted(spec.models[model].versions)[0]
        name = model_cluster(model, version, via)
    elif service == "feature":
        name = feature_cluster(via)
    elif service in ("gateway", "registry"):
        name = service
    else:
        raise DrillError(f"healthy_hosts: unknown service {service!r}")
    admin = drill.admin if name == GATEWAY_CLUSTER else drill.admin_of_zone(via)
    assert admin is not None
    view = admin.clusters().get(name)
    if view is None:
        raise DrillError(f"Envoy has no cluster {name!r}")
    counts = view.healthy_by_zone()
    return counts.get(zone, 0) if zone else sum(counts.values())


def wait_healthy_hosts(
    service: str = "model",
    zone: str | None = None,
    via: str | None = None,
    at_least: int = 1,
    seconds: float = 15.0,
) -> dict[str, Any]:
    """Wait (`seconds` at most) until Envoy holds `at_least` hosts of `service` healthy, as
    `healthy_hosts` counts them; report the count and how long that took.

    After a heal, a host is healthy again only after its health checks pass again: a steady
    state read at once would find a recovered mesh still catching up.
    """
    drill = current()
    start = drill.now_s()
    healthy = healthy_hosts(service, zone, via)
    while healthy < at_least and drill.now_s() - start < float(seconds):
        if not drill.sleep(HEALTH_POLL_S):
            break
        healthy = healthy_hosts(service, zone, via)
    return {
        "healthy": healthy,
        "seconds": round(drill.now_s() - start, 2),
        "in_time": healthy >= at_least,
    }


# --- services and Redis ----------------------------------------------------------------------


def _serving(dial: Dial, timeout_s: float = 1.0) -> bool:
    with dial.channel() as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def services_healthy(service: str | None = None, zone: str | None = None) -> bool:
    """Every replica (of `service`, in `zone`) answers its gRPC health check SERVING."""
    drill = current()
    spec = drill.spec
    chosen = [
        i
        for i in spec.instances()
        if (service is None or i.service == service) and (zone is None or i.zone == zone)
    ]
    return all(_serving(dial_service(spec, i.name)) for i in chosen)


def redis_reachable(timeout_s: float = 0.5) -> bool:
    """Redis answers PING."""
    client = current().running_mesh.redis_client(timeout_s)
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


def try_model_load(
    model: str = "fraud", version: str = "v1", replica: str | None = None, timeout_s: float = 5.0
) -> dict[str, Any]:
    """Ask a model replica to (re)load a version from the registry (OIP RepositoryModelLoad)."""
    drill = current()
    spec = drill.spec
    name = replica or next(i.name for i in spec.instances() if i.service == "model")
    request = oip.RepositoryModelLoadRequest(model_name=model)
    request.parameters["version"].string_param = version
    started = time.perf_counter()
    with dial_service(spec, name).channel() as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.RepositoryModelLoad(
                request, timeout=timeout_s, metadata=control_metadata_for(spec.state_dir)
            )
            code, details = "OK", ""
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details() or ""
    return {
        "replica": name,
        "code": code,
        "details": details[:300],
        "ms": round((time.perf_counter() - started) * 1000, 1),
        "serving_after": _serving(dial_service(spec, name)),
    }


def mirror_refuses_writes(zone: str = "zone-b", model: str = "fraud") -> dict[str, Any]:
    """Ask `zone`'s registry mirror to move an alias, as the operator: a mirror is read-only
    and must refuse it (FAILED_PRECONDITION, naming the registry)."""
    from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

    drill = current()
    spec = drill.spec
    dial = dial_registry_mirror(spec, zone)
    if dial is None:
        raise DrillError(f"{zone} runs no registry mirror (registry.mirrors)")
    request = registry_pb2.SetAliasRequest(model=model, alias="drill", version="v1")
    with dial.channel() as channel:
        try:
            registry_pb2_grpc.RegistryStub(channel).SetAlias(
                request, timeout=5.0, metadata=control_metadata_for(spec.state_dir)
            )
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        else:
            raise DrillError(f"{zone}'s registry mirror moved an alias: it must be read-only")
    if code != "FAILED_PRECONDITION":
        raise DrillError(f"{zone}'s registry mirror answered {code}: {details[:200]}")
    return {"code": code, "details": details[:300]}


def model_load_fails_cleanly(
    model: str = "fraud", version: str = "v1", replica: str | None = None, timeout_s: float = 5.0
) -> bool:
    """A load fails with a plain gRPC status within its deadline, and the replica still
    serves what it had loaded."""
    result = try_model_load(model, version, replica, timeout_s)
    clean = result["code"] in {"UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION"}
    return bool(clean and result["ms"] <= (timeout_s + 1) * 1000 and result["serving_after"])
