"""Chaos Toolkit actions: the faults a drill injects, each with the action that undoes it.

Every fault is scoped (a zone, a service, named replicas, a route or a model version), opens
a fault window on the drill's timeline, and has a matching restore that closes it and is
safe to run twice, so the same restore serves as the method's recovery step and as the
experiment's rollback. Actions act only on the mesh the drill itself started.

| fault | restore |
| --- | --- |
| kill_replicas (SIGKILL) | restart_replicas |
| pause_replicas (SIGSTOP) | resume_replicas |
| start_crash_loop | stop_crash_loop |
| inject_route_fault (Envoy fault filter, runtime keys) | clear_route_fault |
| inject_endpoint_fault (a replica's or a zone's endpoints) | clear_endpoint_fault |
| stop_redis | start_redis |
| pause_redis_clients | unpause_redis_clients |
| slow_redis | restore_redis_speed |
| stop_registry | start_registry |
| start_cpu_hog | stop_cpu_hog |
| set_weights, route_canary | rollback_routes / restore_weights |
| partition_zones (iptables in zone namespaces) | heal_partition |
| run_rollout, start_rollout + kill_rollout_controller + resume_rollout | abort_rollout |

The rollout actions run `servemesh rollout` as operators do, a process of its own
(chaos/rollouts.py): the drill watches the controller decide, and may kill it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from servemesh.chaos.drill import current
from servemesh.chaos.errors import DrillError
from servemesh.chaos.leftovers import LOOP_STEP_MAX_S
from servemesh.chaos.probes import services_healthy
from servemesh.chaos.scope import describe
from servemesh.contract.wire import fault_runtime_prefix
from servemesh.identity import dial_edge_at
from servemesh.launcher import envoy_child
from servemesh.procs.ready import GrpcHealth
from servemesh.proxy.admin import AdminClient, AdminError, admin_socket_path
from servemesh.services.runtime.faults import FaultSettings, control_file, set_fault
from servemesh.spec import MeshSpec
from servemesh.spec.policy import GRPC_CODES

__all__ = [
    "kill_replicas",
    "kill_zone_proxy",
    "await_zone_proxy",
    "kill_edge",
    "restart_edge",
    "await_edge",
    "restart_replicas",
    "pause_replicas",
    "resume_replicas",
    "start_crash_loop",
    "stop_crash_loop",
    "inject_route_fault",
    "clear_route_fault",
    "inject_endpoint_fault",
    "clear_endpoint_fault",
    "stop_redis",
    "start_redis",
    "pause_redis_clients",
    "unpause_redis_clients",
    "slow_redis",
    "restore_redis_speed",
    "stop_registry",
    "start_registry",
    "start_cpu_hog",
    "stop_cpu_hog",
    "set_weights",
    "route_canary",
    "rollback_routes",
    "restore_weights",
    "partition_zones",
    "heal_partition",
    "run_rollout",
    "start_rollout",
    "kill_rollout_controller",
    "resume_rollout",
    "abort_rollout",
]


# --- processes -------------------------------------------------------------------------------


def kill_replicas(
    service: str = "model", zone: str | None = None, replicas: list[str] | None = None
) -> dict[str, Any]:
    """SIGKILL the chosen replicas (e.g. every model replica of zone-a: a zone outage)."""
    drill = current()
    chosen = drill.select(service, zone, replicas)
    scope = describe(service, zone, replicas)
    drill.timeline.open_window(f"kill:{scope}", f"kill {scope}")
    killed = {}
    for inst in chosen:
        pid = drill.kill(inst.name)
        if pid is not None:
            killed[inst.name] = pid
    return {"killed": killed}


def restart_replicas(
    service: str = "model",
    zone: str | None = None,
    replicas: list[str] | None = None,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Start the chosen replicas that are down and wait until each is SERVING."""
    drill = current()
    mesh = drill.running_mesh
    started = {}
    began = time.perf_counter()
    for inst in drill.select(service, zone, replicas):
        if not mesh.is_running(inst.name):
            started[inst.name] = mesh.restart(inst.name, timeout_s=timeout_s)
    drill.timeline.close_window(f"kill:{describe(service, zone, replicas)}")
    return {"restarted": started, "seconds": round(time.perf_counter() - began, 3)}


def kill_zone_proxy(zone: str = "zone-a") -> dict[str, Any]:
    """SIGKILL a zone's Envoy (the per-zone layout's): its gateways lose their way
    downstream until the mesh starts it again (await_zone_proxy)."""
    mesh = current().running_mesh
    if mesh.spec.proxy.layout != "per_zone":
        raise DrillError(
            "a zone's Envoy of its own needs proxy.layout per_zone "
            "(the experiment's `proxy: per_zone`, or --var proxy=per_zone)"
        )
    # A crash, not an outage the drill holds: the mesh's own restart is what it measures.
    return _kill_proxy(zone, f"kill {zone}'s Envoy", revive=True)


def kill_edge(zone: str = "zone-a") -> dict[str, Any]:
    """SIGKILL a zone's edge Envoy (proxy.edges per_zone) and hold it down until
    restart_edge: callers given every edge's address go on through the others meanwhile."""
    spec = current().running_mesh.spec
    if not spec.edges_per_zone:
        raise DrillError(
            "an edge per zone needs proxy.layout per_zone and proxy.edges per_zone "
            "(the drill mesh's default)"
        )
    if zone not in spec.zones:
        raise DrillError(f"zone: no zone named {zone!r}; zones: {spec.zones}")
    # An outage the drill holds: callers going on without it is what it measures.
    return _kill_proxy(_edge_of(spec, zone), f"kill {zone}'s edge", revive=False)


def restart_edge(zone: str = "zone-a", timeout_s: float = 30.0) -> dict[str, Any]:
    """Start the zone's edge Envoy that kill_edge holds down again (its admin ready); the
    kill window stays open until await_edge sees it serving."""
    drill = current()
    mesh = drill.running_mesh
    name = envoy_child(_edge_of(mesh.spec, zone))
    if mesh.is_running(name):
        return {"restarted": {}}
    began = time.perf_counter()
    pid = mesh.restart(name, timeout_s=timeout_s)
    return {"restarted": {name: pid}, "seconds": round(time.perf_counter() - began, 3)}


def _edge_of(spec: MeshSpec, zone: str) -> str:
    return spec.edge_proxies()[spec.zones.index(zone)]


@dataclass
class _KilledProxies:
    """The PID each Envoy had when a kill step killed it: the await step waits for another."""

    pids: dict[str, int | None] = field(default_factory=dict)


def _kill_proxy(proxy: str, label: str, *, revive: bool) -> dict[str, Any]:
    """SIGKILL one of the mesh's Envoys in a kill window; `revive`: the mesh starts it
    again (a crash), else it stays down until the drill starts it (an outage)."""
    drill = current()
    name = envoy_child(proxy)
    drill.timeline.open_window(f"kill:{name}", label)
    pid = drill.kill(name, revive=revive)
    drill.handoff(_KilledProxies).pids[name] = pid
    return {"killed": {name: pid}}


def await_zone_proxy(zone: str = "zone-a", timeout_s: float = 30.0) -> dict[str, Any]:
    """Until the mesh has started the zone's Envoy again by itself (a new process, its
    admin API ready) and the zone's gateways are SERVING again; closes the kill window.
    Says how long the zone's Envoy was gone."""
    return _await_proxy(
        zone, lambda: services_healthy("gateway", zone), "its zone's gateways SERVING", timeout_s
    )


def await_edge(zone: str = "zone-a", timeout_s: float = 30.0) -> dict[str, Any]:
    """Until the zone's edge runs again (a new process, its admin API ready) and answers
    gRPC health SERVING on its edge port; closes the kill window."""
    spec = current().running_mesh.spec
    proxy = _edge_of(spec, zone)
    health = GrpcHealth(dial_edge_at(spec, spec.edge_address_of(proxy)))
    try:
        return _await_proxy(proxy, health.check, "its edge listener SERVING", timeout_s)
    finally:
        health.close()


def _await_proxy(
    proxy: str, serving: Callable[[], bool], what: str, timeout_s: float
) -> dict[str, Any]:
    drill = current()
    mesh = drill.running_mesh
    name = envoy_child(proxy)
    began = time.perf_counter()
    give_up = time.monotonic() + timeout_s
    killed = drill.handoff(_KilledProxies).pids.get(name)
    admin = AdminClient(admin_socket_path(mesh.state_dir, proxy))

    def back() -> bool:
        if not mesh.is_running(name) or mesh.pid(name) == killed:
            return False
        return admin.is_ready() and serving()

    while not back():
        if time.monotonic() > give_up:
            raise DrillError(f"{name} was not running with {what} within {timeout_s:g} s")
        time.sleep(0.05)
    drill.timeline.close_window(f"kill:{name}")
    return {"pid": mesh.pid(name), "seconds": round(time.perf_counter() - began, 3)}


def pause_replicas(
    service: str = "model", zone: str | None = None, replicas: list[str] | None = None
) -> dict[str, Any]:
    """SIGSTOP the chosen replicas: alive, ports open, answering nothing (a hung process)."""
    drill = current()
    scope = describe(service, zone, replicas)
    drill.timeline.open_window(f"pause:{scope}", f"pause {scope}")
    paused = {}
    for inst in drill.select(service, zone, replicas):
        pid = drill.pause(inst.name)
        if pid is not None:
            paused[inst.name] = pid
    return {"paused": paused}


def resume_replicas(
    service: str = "model", zone: str | None = None, replicas: list[str] | None = None
) -> dict[str, Any]:
    """SIGCONT what pause_replicas stopped."""
    drill = current()
    resumed = [i.name for i in drill.select(service, zone, replicas) if drill.resume(i.name)]
    drill.timeline.close_window(f"pause:{describe(service, zone, replicas)}")
    return {"resumed": resumed}


def start_crash_loop(
    service: str = "model",
    zone: str | None = None,
    replicas: list[str] | None = None,
    up_s: float = 3.0,
    down_s: float = 1.0,
) -> dict[str, Any]:
    """Crash the chosen replicas again and again: SIGKILL, `down_s` dead, restart, `up_s` up."""
    drill = current()
    mesh = drill.running_mesh
    names = [i.name for i in drill.select(service, zone, replicas)]
    crashes: list[float] = []

    def loop(stop: threading.Event) -> None:
        while not stop.is_set():
            for name in names:
                drill.kill(name)
            crashes.append(drill.now_s())
            if stop.wait(down_s):
                return
            for name in names:
                if not mesh.is_running(name):
                    mesh.restart(name, timeout_s=LOOP_STEP_MAX_S)
            stop.wait(up_s)

    drill.timeline.open_window("crash-loop", f"crash loop {', '.join(names)}")
    drill.leftovers.start_background("crash-loop", loop)
    return {"replicas": names, "up_s": up_s, "down_s": down_s}


def stop_crash_loop(timeout_s: float = 60.0) -> dict[str, Any]:
    """Stop crashing, and bring every replica the loop left dead back."""
    drill = current()
    stopped = drill.leftovers.stop_background("crash-loop")
    mesh = drill.running_mesh
    restarted = []
    for inst in drill.spec.instances():
        if inst.service != "registry" and not mesh.is_running(inst.name):
            mesh.restart(inst.name, timeout_s=timeout_s)
            restarted.append(inst.name)
    drill.timeline.close_window("crash-loop")
    return {"stopped": bool(stopped), "restarted": restarted}


# --- faults on routes and endpoints ----------------------------------------------------------


def inject_route_fault(
    route: str = "model.fraud",
    abort_percent: int = 0,
    abort_status: str = "UNAVAILABLE",
    delay_percent: int = 0,
    delay_ms: int = 0,
) -> dict[str, Any]:
    """Envoy's fault filter on a route (`model.<name>`, `feature`, `edge`): exact percentages
    of calls aborted with a gRPC status, or delayed, set live through runtime keys on every
    Envoy that serves the route (each zone's own, in the per-zone layout)."""
    drill = current()
    if abort_status not in GRPC_CODES:
        raise DrillError(f"abort_status {abort_status!r}: one of {sorted(GRPC_CODES)}")
    for name, value in (("abort_percent", abort_percent), ("delay_percent", delay_percent)):
        if not 0 <= int(value) <= 100:
            raise DrillError(f"{name} must be within 0..100, got {value}")
    prefix = fault_runtime_prefix(route)
    values: dict[str, str | int | float] = {
        f"{prefix}.abort_percent": int(abort_percent),
        f"{prefix}.abort_grpc_status": GRPC_CODES[abort_status],
        f"{prefix}.delay_percent": int(delay_percent),
        f"{prefix}.delay_ms": int(delay_ms),
    }
    for admin in drill.route_admins(route):
        admin.set_runtime(values)
    what = []
    if abort_percent:
        what.append(f"{abort_percent}% {abort_status}")
    if delay_percent and delay_ms:
        what.append(f"+{delay_ms} ms on {delay_percent}%")
    drill.timeline.open_window(f"route:{route}", f"route {route}: {', '.join(what) or 'no-op'}")
    return {"runtime": values}


def clear_route_fault(route: str = "model.fraud") -> dict[str, Any]:
    drill = current()
    prefix = fault_runtime_prefix(route)
    values: dict[str, str | int | float] = {
        f"{prefix}.abort_percent": 0,
        f"{prefix}.delay_percent": 0,
    }
    skipped = []
    for admin in drill.route_admins(route):
        try:
            admin.set_runtime(values)
        except AdminError:
            # An Envoy a drill killed: its runtime keys went with it, and the one started in
            # its place begins with none.
            skipped.append(str(admin.socket_path))
    drill.timeline.close_window(f"route:{route}")
    return {"runtime": values, "not_answering": skipped}


def inject_endpoint_fault(
    service: str = "model",
    zone: str | None = None,
    replicas: list[str] | None = None,
    error_percent: float = 0.0,
    error_code: str = "UNAVAILABLE",
    delay_percent: float = 0.0,
    delay_ms: float = 0.0,
) -> dict[str, Any]:
    """Errors or latency on the chosen replicas' serving calls (e.g. +200 ms on every model
    replica of zone-a: a zone brownout). Health checks are never faulted."""
    drill = current()
    settings = FaultSettings(
        error_percent=error_percent,
        error_code=error_code,
        delay_percent=delay_percent,
        delay_ms=delay_ms,
    )
    scope = describe(service, zone, replicas)
    applied = []
    mesh = drill.running_mesh
    for inst in drill.select(service, zone, replicas):
        if mesh.is_running(inst.name):
            set_fault(mesh.state_dir, inst.name, settings)
            applied.append(inst.name)
    what = []
    if error_percent:
        what.append(f"{error_percent:g}% {error_code}")
    if delay_percent and delay_ms:
        what.append(f"+{delay_ms:g} ms on {delay_percent:g}%")
    drill.timeline.open_window(f"endpoint:{scope}", f"{scope}: {', '.join(what) or 'no-op'}")
    return {"replicas": applied}


def clear_endpoint_fault(
    service: str = "model", zone: str | None = None, replicas: list[str] | None = None
) -> dict[str, Any]:
    drill = current()
    mesh = drill.running_mesh
    cleared = []
    for inst in drill.select(service, zone, replicas):
        if mesh.is_running(inst.name) and not drill.leftovers.is_paused(inst.name):
            set_fault(mesh.state_dir, inst.name, None)
        else:  # a dead (or stopped) replica reads no control file when it starts again
            control_file(mesh.state_dir, inst.name).unlink(missing_ok=True)
        cleared.append(inst.name)
    drill.timeline.close_window(f"endpoint:{describe(service, zone, replicas)}")
    return {"replicas": cleared}


# --- Redis -----------------------------------------------------------------------------------


def stop_redis() -> dict[str, Any]:
    """Redis outage: snapshot, then SIGKILL the server the drill's mesh started."""
    drill = current()
    pid = drill.running_mesh.stop_redis()
    drill.timeline.open_window("redis:down", "Redis down")
    return {"killed": pid}


def start_redis() -> dict[str, Any]:
    """Start Redis again on its port, from the snapshot; no-op when it is running."""
    drill = current()
    began = time.perf_counter()
    pid = drill.running_mesh.start_redis()
    drill.timeline.close_window("redis:down")
    return {"pid": pid, "seconds": round(time.perf_counter() - began, 3)}


def _redis_command(*args: Any, timeout_s: float = 2.0) -> Any:
    client = current().running_mesh.redis_client(timeout_s)
    try:
        return client.execute_command(*args)
    finally:
        client.close()


def pause_redis_clients(seconds: float = 30.0) -> dict[str, Any]:
    """Redis alive but answering nobody (CLIENT PAUSE ALL) for `seconds` at most."""
    drill = current()
    _redis_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
    drill.timeline.open_window("redis:paused", "Redis clients paused")
    return {"paused_s": seconds}


def unpause_redis_clients() -> dict[str, Any]:
    """CLIENT UNPAUSE. The Redis shipped here queues the UNPAUSE behind the pause itself, so
    in practice this returns when the pause ends at its own deadline."""
    drill = current()
    try:
        _redis_command("CLIENT", "UNPAUSE", timeout_s=5.0)
    except redis.exceptions.RedisError as exc:
        # The pause ends by itself at its deadline; report rather than fail the rollback.
        drill.timeline.close_window("redis:paused")
        return {"unpaused": False, "error": str(exc)}
    drill.timeline.close_window("redis:paused")
    return {"unpaused": True}


def slow_redis(stall_ms: int = 200, every_ms: int = 400) -> dict[str, Any]:
    """A slow Redis: every `every_ms` it stalls all clients for `stall_ms` (CLIENT PAUSE),
    like a server busy forking or flushing. (tc netem is not available to add latency.)"""
    drill = current()
    if stall_ms <= 0 or every_ms <= stall_ms:
        raise DrillError("slow_redis needs 0 < stall_ms < every_ms")

    def loop(stop: threading.Event) -> None:
        client = drill.running_mesh.redis_client(timeout_s=2.0)
        try:
            while not stop.is_set():
                try:
                    client.execute_command("CLIENT", "PAUSE", int(stall_ms), "ALL")
                except redis.exceptions.RedisError:
                    pass
                stop.wait(every_ms / 1000)
        finally:
            client.close()

    drill.leftovers.start_background("slow-redis", loop)
    drill.timeline.open_window("redis:slow", f"Redis stalls {stall_ms} ms every {every_ms} ms")
    return {"stall_ms": stall_ms, "every_ms": every_ms}


def restore_redis_speed() -> dict[str, Any]:
    drill = current()
    stopped = drill.leftovers.stop_background("slow-redis")
    drill.timeline.close_window("redis:slow")
    return {"stopped": bool(stopped)}


# --- the registry ----------------------------------------------------------------------------


def stop_registry() -> dict[str, Any]:
    """Registry outage: SIGKILL the registry. Serving needs no registry; loads do."""
    drill = current()
    killed = {}
    for inst in drill.select("registry"):
        pid = drill.kill(inst.name)
        if pid is not None:
            killed[inst.name] = pid
    drill.timeline.open_window("registry:down", "registry down")
    return {"killed": killed}


def start_registry(timeout_s: float = 60.0) -> dict[str, Any]:
    """Start the registry again (same port, same store) and wait until it is SERVING."""
    drill = current()
    mesh = drill.running_mesh
    started = {}
    for inst in drill.select("registry"):
        if not mesh.is_running(inst.name):
            started[inst.name] = mesh.restart(inst.name, timeout_s=timeout_s)
    drill.timeline.close_window("registry:down")
    return {"restarted": started}


# --- CPU -------------------------------------------------------------------------------------


def start_cpu_hog(zone: str | None = None, workers: int = 1) -> dict[str, Any]:
    """Processes that each burn a CPU, pinned to the CPUs the zone's processes may use.

    On one machine the zones share the CPUs unless they were pinned apart, so a hog "in a
    zone" competes with every zone that shares its CPUs: the drill shows what that does.
    """
    drill = current()
    cpus: set[int] | None = None
    if zone is not None:
        drill.select("model", zone)  # the zone exists and has model replicas
        running = drill.running_mesh.pids_of("model", zone)
        if running:
            cpus = os.sched_getaffinity(next(iter(running.values())))
    pids = []
    for _ in range(max(1, int(workers))):
        pid = drill.leftovers.spawn_hog()
        if cpus:
            os.sched_setaffinity(pid, cpus)
        pids.append(pid)
    drill.timeline.open_window("cpu-hog", f"CPU hog x{len(pids)} ({zone or 'all zones'})")
    return {"pids": pids, "cpus": sorted(cpus) if cpus else None}


def stop_cpu_hog() -> dict[str, Any]:
    drill = current()
    stopped = drill.leftovers.stop_hogs()
    drill.timeline.close_window("cpu-hog")
    return {"stopped": stopped}


# --- routes ----------------------------------------------------------------------------------


def set_weights(model: str = "fraud", weights: dict[str, int] | None = None) -> dict[str, Any]:
    """Change a model's traffic split live (e.g. a canary at 10%), recorded in the history."""
    drill = current()
    if not weights:
        raise DrillError("set_weights needs weights, e.g. {v1: 90, v2: 10}")
    assert drill.routes is not None
    result = drill.routes.set_weights(model, {k: int(v) for k, v in weights.items()}, who="drill")
    canaries = {
        v: w for v, w in weights.items() if w and not drill.initial_weights.get(model, {}).get(v)
    }
    label = ", ".join(f"{v} at {w}%" for v, w in canaries.items()) or "weights changed"
    drill.timeline.open_window(f"weights:{model}", f"{model}: {label}")
    return {"change": result.entry_id, "confirm_ms": round(result.confirm_ms, 1)}


def route_canary(model: str = "fraud", version: str = "v2", percent: int = 10) -> dict[str, Any]:
    """Send `percent`% of a model's unpinned calls to `version`, the rest to the version that
    had the most traffic when the drill began."""
    drill = current()
    initial = drill.initial_weights.get(model)
    if initial is None:
        raise DrillError(f"model {model!r} is not served; models: {sorted(drill.initial_weights)}")
    stable = max((v for v in initial if v != version), key=lambda v: initial[v], default=None)
    if stable is None:
        raise DrillError(f"model {model!r} has no version besides {version!r}")
    weights = {v: 0 for v in initial}
    weights[version] = int(percent)
    weights[stable] = 100 - int(percent)
    return set_weights(model, weights)


def rollback_routes() -> dict[str, Any]:
    """What an operator does: `servemesh routes rollback` (undo the last change)."""
    drill = current()
    assert drill.routes is not None
    result = drill.routes.rollback(who="drill")
    drill.timeline.close_windows("weights:")
    return {"change": result.entry_id, "confirm_ms": round(result.confirm_ms, 1)}


def restore_weights(model: str | None = None) -> dict[str, Any]:
    """Put the split back as the drill found it; nothing to do when it already is."""
    drill = current()
    assert drill.routes is not None
    live = drill.routes.live_spec()
    restored = []
    for name, weights in drill.initial_weights.items():
        if model is not None and name != model:
            continue
        if dict(live.models[name].traffic) != weights:
            drill.routes.set_weights(name, weights, who="drill rollback")
            restored.append(name)
    drill.timeline.close_windows("weights:")
    return {"restored": restored}


# --- rollouts: the controller decides ---------------------------------------------------------


_DEFAULT_STEPS: list[int | None] = [None, 25, 50, 100]


def _rollout_plan(
    steps: list[int | None] | None,
    dwell: str,
    min_requests: int,
    interval: str,
    min_samples: int,
    analysis: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "steps": [
            {"weight": w, "dwell": dwell, "min_requests": int(min_requests)}
            for w in (steps if steps is not None else _DEFAULT_STEPS)
        ],
        "analysis": {"interval": interval, "min_samples": int(min_samples), **(analysis or {})},
        "deadline": "30m",
    }


def _start_args(model: str, version: str, plan_path: str) -> list[str]:
    return ["start", model, version, "--plan", plan_path]


def run_rollout(
    model: str = "fraud",
    version: str = "v2",
    steps: list[int | None] | None = None,
    dwell: str = "2s",
    min_requests: int = 20,
    interval: str = "1s",
    min_samples: int = 20,
    analysis: dict[str, Any] | None = None,
    expect: str = "",
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """`servemesh rollout start` to its end: the controller promotes the version or rolls it
    back on its own. `expect` ("promoted", "rolled back", "refused"): anything else fails
    the activity, naming the controller's reason."""
    from servemesh.chaos import rollouts

    drill = current()
    plan = _rollout_plan(steps, dwell, min_requests, interval, min_samples, analysis)
    try:
        child = _start_controller(drill, model, version, plan)
        result = rollouts.finished(drill, child, timeout_s)
    finally:
        drill.timeline.close_window(f"rollout:{model}")
    drill.timeline.mark(f"rollout {result['outcome']}", "activity")
    if expect and result["outcome"] != expect:
        raise DrillError(f"the rollout was {result['outcome']}, not {expect}: {result['reason']}")
    return result


def _start_controller(drill: Any, model: str, version: str, plan: dict[str, Any]) -> Any:
    """`servemesh rollout start` with `plan` as a child of the drill, its rollout window
    opened on the timeline."""
    from servemesh.chaos import rollouts

    name = f"rollout-{model}-{version}"
    path = rollouts.write_plan(drill, name, plan)
    drill.timeline.open_window(f"rollout:{model}", f"{model}: rollout of {version}")
    return rollouts.command(drill, name, *_start_args(model, version, str(path)))


def start_rollout(
    model: str = "fraud",
    version: str = "v2",
    steps: list[int | None] | None = None,
    dwell: str = "2s",
    min_requests: int = 20,
    interval: str = "1s",
    min_samples: int = 20,
    analysis: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`servemesh rollout start` in the background (kill_rollout_controller, resume_rollout
    and abort_rollout act on it)."""

    drill = current()
    plan = _rollout_plan(steps, dwell, min_requests, interval, min_samples, analysis)
    child = _start_controller(drill, model, version, plan)
    return {"pid": child.pid, "plan": plan}


def kill_rollout_controller(
    model: str = "fraud", version: str = "v2", at_step: str = "50%", timeout_s: float = 120.0
) -> dict[str, Any]:
    """SIGKILL the rollout's controller once it has reached `at_step`: the routes stay as
    that step set them, the state file says where it was, and nobody drives it."""
    from servemesh.chaos import rollouts

    drill = current()
    name = f"rollout-{model}-{version}"
    supervisor = drill.leftovers.commands(drill.out_dir / "rollouts")
    child = supervisor.child(name)
    reached = rollouts.wait_for_step(drill, model, version, at_step, child, timeout_s)
    pid = supervisor.kill(name)
    drill.timeline.mark(f"rollout controller killed at {at_step}", "activity")
    return {"killed": pid, "step": reached.step_label, "weights": reached.weights}


def resume_rollout(
    model: str = "fraud", expect: str = "promoted", timeout_s: float = 300.0
) -> dict[str, Any]:
    """`servemesh rollout resume`: with no controller alive, it becomes the controller and
    continues from the recorded step, to the rollout's end."""
    from servemesh.chaos import rollouts

    drill = current()
    child = rollouts.command(drill, f"resume-{model}", "resume", model)
    try:
        result = rollouts.finished(drill, child, timeout_s)
    finally:
        drill.timeline.close_window(f"rollout:{model}")
    drill.timeline.mark(f"rollout {result['outcome']}", "activity")
    if expect and result["outcome"] != expect:
        raise DrillError(f"the rollout was {result['outcome']}, not {expect}: {result['reason']}")
    return result


def abort_rollout(model: str = "fraud", timeout_s: float = 120.0) -> dict[str, Any]:
    """Undo any rollout the drill left under way: its controller stopped, then `servemesh
    rollout abort` (the baseline back at 100). Nothing to do when none is under way."""
    from servemesh.chaos import rollouts

    drill = current()
    supervisor = drill.leftovers.commands(drill.out_dir / "rollouts")
    stopped = [name for name in supervisor.children if supervisor.is_running(name)]
    for name in list(supervisor.children):
        supervisor.stop(name)
    drill.timeline.close_windows("rollout:")
    current_state = rollouts.state(drill, model)
    if current_state is None or not current_state.active:
        return {"stopped": stopped, "aborted": False}
    child = rollouts.command(drill, f"abort-{model}", "abort", model, "--reason", "drill rollback")
    result = rollouts.finished(drill, child, timeout_s)
    return {"stopped": stopped, "aborted": result["exit"] == 0, "reason": result["reason"]}


# --- the network between zones ---------------------------------------------------------------


def partition_zones(zones: list[str] | None = None) -> dict[str, Any]:
    """Drop all traffic between two zones, with iptables inside their network namespaces.

    Needs the drill's mesh to run its zones in namespaces (configuration `network: netns`,
    as root)."""
    drill = current()
    if drill.network is None:
        raise DrillError(
            "partition_zones needs zones in their own network namespaces: run the drill with "
            "`network: netns` (as root); this mesh runs every zone on one loopback"
        )
    pair = list(zones or drill.spec.zones[:2])
    if len(pair) != 2:
        raise DrillError(f"partition_zones takes two zones, got {pair}")
    rules = drill.network.partition(pair[0], pair[1])
    drill.timeline.open_window("partition", f"partition {pair[0]} / {pair[1]}")
    return {"zones": pair, "rules": rules}


def heal_partition() -> dict[str, Any]:
    drill = current()
    removed = drill.network.heal() if drill.network is not None else []
    drill.timeline.close_window("partition")
    return {"removed": removed}
