"""Chaos Toolkit actions of the container drills (`mesh: compose`): the faults an operator
of containers meets, each with the action that undoes it, on the drill's own compose
project (chaos/containers.py).

| fault | restore |
| --- | --- |
| crash_container (its process SIGKILLed on the host) | await_container (restarted, healthy) |
| stop_container (`docker stop`: left down by the restart policy) | start_container |
| pause_zone (`docker pause` of a zone's containers) | unpause_zone |
| partition_zone_networks (each zone's Envoy off the other zone's network) | join_zone_networks |
| throttle_zone (`docker update --cpus`) | unthrottle_zone |

Each fault opens a window on the drill's timeline that its restore closes; each restore is
safe to run twice, so it serves as the method's recovery step and as the rollback. The
partition and the throttle check that they bit (the cut from inside each zone's Envoy, the
cgroups' throttled periods), so a fault that did nothing fails the drill instead of
passing it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from servemesh.chaos.containers import ComposeMesh, docker
from servemesh.chaos.drill import current
from servemesh.chaos.errors import DrillError

__all__ = [
    "crash_container",
    "await_container",
    "stop_container",
    "start_container",
    "pause_zone",
    "unpause_zone",
    "partition_zone_networks",
    "join_zone_networks",
    "throttle_zone",
    "unthrottle_zone",
    "zone_was_throttled",
]

# Restart counts before a crash, by service: await_container waits for a larger one.
_restarts: dict[str, int] = {}
# Throttled periods before the throttle, by service.
_throttled: dict[str, int] = {}
# What pause_zone froze and partition_zone_networks cut, so the restores undo exactly that.
_paused: dict[str, list[str]] = {}
_cut: dict[str, str] = {}


def _compose() -> ComposeMesh:
    drill = current()
    if drill.compose is None:
        raise DrillError("a container action needs a drill on containers (`mesh: compose`)")
    return drill.compose


def _until(ready: Any, what: str, timeout_s: float) -> float:
    """Poll `ready()` until true; the seconds it took. A DrillError naming `what` after
    `timeout_s`."""
    began = time.monotonic()
    while not ready():
        if time.monotonic() - began > timeout_s:
            raise DrillError(f"{what} not within {timeout_s:g} s")
        time.sleep(0.25)
    return round(time.monotonic() - began, 2)


def crash_container(service: str) -> dict[str, Any]:
    """SIGKILL the container's process from the host: the engine's restart policy is what
    brings it back (await_container)."""
    mesh = _compose()
    _restarts[service] = mesh.restarts(service)
    current().timeline.open_window(f"crash:{service}", f"crash {service}")
    return {"killed": {service: mesh.crash(service)}}


def await_container(service: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Until the engine has started the container again and it is healthy; closes the
    crash window."""
    mesh = _compose()
    before = _restarts.get(service, -1)
    seconds = _until(
        lambda: mesh.restarts(service) > before and mesh.healthy(service),
        f"{service}'s container restarted and healthy",
        timeout_s,
    )
    current().timeline.close_window(f"crash:{service}")
    return {"service": service, "seconds": seconds, "restarts": mesh.restarts(service)}


def stop_container(service: str) -> dict[str, Any]:
    """`docker stop`: a deliberate outage, which the restart policy leaves down."""
    mesh = _compose()
    docker("stop", mesh.container(service))
    current().timeline.open_window(f"stop:{service}", f"{service} stopped")
    return {"stopped": service}


def start_container(service: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Start it again and wait until it is healthy; closes the stop window."""
    mesh = _compose()
    docker("start", mesh.container(service))
    seconds = _until(lambda: mesh.healthy(service), f"{service} healthy again", timeout_s)
    current().timeline.close_window(f"stop:{service}")
    return {"started": service, "seconds": seconds}


def pause_zone(zone: str = "zone-a") -> dict[str, Any]:
    """Freeze every container of the zone (`docker pause`: the cgroup freezer): alive,
    ports open, answering nothing, as a zone whose hosts hang."""
    mesh = _compose()
    services = mesh.zone_services(zone)
    docker("pause", *(mesh.container(s) for s in services))
    _paused[zone] = services
    current().timeline.open_window(f"pause:{zone}", f"{zone} frozen")
    return {"paused": services}


def unpause_zone(zone: str = "zone-a") -> dict[str, Any]:
    mesh = _compose()
    services = _paused.pop(zone, [])
    frozen = [s for s in services if mesh.inspect(mesh.container(s))["State"]["Paused"]]
    if frozen:
        docker("unpause", *(mesh.container(s) for s in frozen))
    current().timeline.close_window(f"pause:{zone}")
    return {"unpaused": frozen}


def _across(mesh: ComposeMesh, zone: str, other: str) -> str:
    """The address of the other zone's first model server, as a zone's Envoy dials it."""
    model = next(i for i in mesh.spec.instances() if i.zone == other and i.service == "model")
    return f"{mesh.spec.host_of(model.name)}:{mesh.spec.port_of(model.name)}"


def partition_zone_networks() -> dict[str, Any]:
    """Disconnect each zone's Envoy from the other zone's network, the one path between
    the zones in the compose file; then check from inside each zone's Envoy that the other
    zone's model server is out of reach (a DrillError when it is not: the cut did not
    happen)."""
    mesh = _compose()
    zones = mesh.spec.zones[:2]
    if len(zones) < 2:
        raise DrillError("a partition needs two zones")
    drill = current()
    drill.timeline.open_window("partition", f"partition {zones[0]} / {zones[1]}")
    for zone, other in ((zones[0], zones[1]), (zones[1], zones[0])):
        docker("network", "disconnect", mesh.network(other), mesh.container(f"envoy-{zone}"))
        _cut[zone] = other
    still = [z for z, o in _cut.items() if mesh.reaches(f"envoy-{z}", _across(mesh, z, o))]
    if still:
        raise DrillError(
            f"the partition did not cut: envoy-{still[0]} still reaches the other zone"
        )
    return {"cut": dict(_cut)}


def join_zone_networks() -> dict[str, Any]:
    """Connect each zone's Envoy to the other zone's network again (under its own name) and
    check that it reaches the other zone's model server."""
    mesh = _compose()
    joined = {}
    for zone, other in list(_cut.items()):
        envoy = f"envoy-{zone}"
        docker("network", "connect", "--alias", envoy, mesh.network(other), mesh.container(envoy))
        joined[zone] = _until(
            lambda z=zone, o=other: mesh.reaches(f"envoy-{z}", _across(mesh, z, o)),
            f"envoy-{zone} reaching {other} again",
            60.0,
        )
        del _cut[zone]
    current().timeline.close_window("partition")
    return {"joined": joined}


def throttle_zone(zone: str = "zone-a", cpus: float = 0.05) -> dict[str, Any]:
    """A brownout: every container of the zone limited to `cpus` of a core (its cgroups'
    CFS quota, `docker update --cpus`)."""
    mesh = _compose()
    services = mesh.zone_services(zone)
    for service in services:
        _throttled[service] = mesh.throttled_periods(service)
    docker("update", "--cpus", str(cpus), *(mesh.container(s) for s in services))
    current().timeline.open_window(f"throttle:{zone}", f"{zone} at {cpus:g} CPU")
    return {"throttled": services, "cpus": cpus}


def zone_was_throttled(zone: str = "zone-a") -> dict[str, int]:
    """The throttled periods each of the zone's containers gained since throttle_zone; a
    DrillError when none gained any (the limit never bit)."""
    mesh = _compose()
    grew = {s: mesh.throttled_periods(s) - n for s, n in _throttled.items() if s in
            mesh.zone_services(zone)}  # fmt: skip
    if not grew or max(grew.values()) <= 0:
        raise DrillError(f"{zone}'s containers were never throttled: {grew}")
    return grew


def unthrottle_zone(zone: str = "zone-a") -> dict[str, Any]:
    """Give the zone's containers the host's cores back (`--cpus` to the core count: 0
    does not lift a limit on every engine)."""
    mesh = _compose()
    services = mesh.zone_services(zone)
    docker("update", "--cpus", str(os.cpu_count() or 1), *(mesh.container(s) for s in services))
    current().timeline.close_window(f"throttle:{zone}")
    return {"unthrottled": services}
