"""Changing how many replicas of a kind (model servers, gateways, feature services) a zone
runs, in the running mesh, without losing a call.

A zone's replicas are `<kind>-<zone>-0 .. N-1` (model servers: `model-<zone>-i`); the first
R are in rotation, the rest (`fleet.standby`) run but Envoy is told they are DRAINING, so no
new call reaches them. Each step is one change of the resolved spec's fleet through the
route manager (rendered, validated, swapped, confirmed by Envoy, recorded in `routes
history`), which `servemesh up` follows by starting and stopping processes by PID
(servemesh.launcher):

- **grow** to R': standbys already ready join the rotation first (one change: seconds).
  Then, when more are needed, N grows: the new replicas start out of rotation, and join it
  (one more change) only once each is ready on its own health service (a model server:
  every version SERVING, loaded and warmed; a gateway or feature service: its own deep
  health SERVING, its dependencies reachable); then Envoy must count them healthy. Last,
  the pool's `standby` replicas are started again behind the rotation.
- **shrink** to R': the replicas past R' leave the rotation (DRAINING: calls in flight
  finish, no new ones come), and once Envoy has no call open to those that go (or after
  `drain_timeout`), N shrinks: the mesh stops them with SIGTERM, and each drains itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from servemesh.contract.errors import ServemeshError
from servemesh.contract.wire import GATEWAY_CLUSTER, feature_cluster
from servemesh.proxy.admin import AdminError
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.replicas import (
    clusters_listing,
    envoy_hosts,
    served_health_names,
    version_health,
)
from servemesh.rollout.fleet import fleet_status
from servemesh.spec import (
    SHARED_POOL,
    FleetState,
    ResolvedSpec,
    ScaledKind,
    instance_name,
    resolve,
    scaled_pool_label,
)

log = logging.getLogger(__name__)


class ScaleError(ServemeshError, RuntimeError):
    """A scaling step could not be made or confirmed; the message says which and why."""


def zone_replicas(
    spec: ResolvedSpec, zone: str, kind: ScaledKind = "model", pool: str | None = None
) -> tuple[list[str], list[str]]:
    """The zone's replicas of `kind` (model servers: of the first set, of `pool`; None: the
    first model's pool), (in rotation, standby), in index order."""
    if kind == "model" and pool is None:
        pool = spec.pool_names()[0]
    standby = set(spec.fleet.standby)
    names = [
        i.name
        for i in spec.instances()
        if i.service == kind
        and i.zone == zone
        and (kind != "model" or (i.pool == pool and i.replica_set == spec.fleet.home_of(pool)))
    ]
    return [n for n in names if n not in standby], [n for n in names if n in standby]


def busy_with_an_update(spec: ResolvedSpec) -> str:
    """Why the fleet is not the scaler's to change now ("" when it is)."""
    if spec.discovery.backend == "dns":
        return (
            "discovery.backend 'dns': replicas are added by whoever owns the names "
            "(docker compose --scale, a Swarm service, a Kubernetes Deployment), not this mesh"
        )
    if spec.discovery.backend != "file":
        return (
            f"discovery.backend {spec.discovery.backend!r}: replicas are added by the "
            "catalog's owner, not this mesh"
        )
    if spec.network.mode == "netns":
        return "network.mode netns: a zone's ports are joined at start"
    if len(spec.fleet.sets) > 1:
        return "a blue-green update holds a second set"
    if spec.fleet.draining:
        return "a rolling update is replacing replicas"
    return ""


@dataclass
class PoolActuator:
    manager: RouteManager
    ready_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    poll_s: float = 0.2
    kind: ScaledKind = "model"
    # The model servers' pool it scales (gateways and feature services: SHARED_POOL).
    pool: str = SHARED_POOL
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    # --- the two moves ------------------------------------------------------------------

    def grow(self, zone: str, to: int, standby: int, reason: str) -> list[str]:
        """Put `to` replicas of `zone` in rotation, keeping `standby` warm behind them;
        the names that joined the rotation."""
        live = self.manager.live_spec()
        rotation, spare = zone_replicas(live, zone, self.kind, self.pool)
        warm = self._warm(live, spare[: max(0, to - len(rotation))])
        joined: list[str] = []
        if warm:
            count = len(rotation) + len(warm)
            self._layout(zone, len(rotation) + len(spare), count, f"{reason}: standby in")
            joined += warm
            rotation += warm
        if len(rotation) < to:
            live = self.manager.live_spec()
            total = sum(len(names) for names in zone_replicas(live, zone, self.kind, self.pool))
            wanted_total = max(total, to)
            self._layout(zone, wanted_total, len(rotation), f"{reason}: starting")
            fresh = self._names(zone, to)[len(rotation) :]
            self._wait_ready(fresh)
            self._layout(zone, wanted_total, to, f"{reason}: in rotation")
            self._wait_envoy(fresh)
            joined += fresh
        self.keep_standby(zone, standby, reason)
        return joined

    def shrink(self, zone: str, to: int, standby: int, reason: str) -> list[str]:
        """Take `zone` down to `to` replicas in rotation (and `standby` behind them); the
        names that were stopped."""
        live = self.manager.live_spec()
        rotation, spare = zone_replicas(live, zone, self.kind, self.pool)
        total = len(rotation) + len(spare)
        self._layout(zone, total, to, f"{reason}: draining")
        keep = to + standby
        leaving = self._names(zone, total)[keep:]
        self._wait_drained(leaving)
        if keep < total:
            self._layout(zone, keep, to, f"{reason}: stopping")
        return leaving

    def keep_standby(self, zone: str, standby: int, reason: str = "standby") -> list[str]:
        """Start standbys behind the rotation until the zone has `standby` of them (they warm
        on their own; a grow checks them before they join)."""
        live = self.manager.live_spec()
        rotation, spare = zone_replicas(live, zone, self.kind, self.pool)
        if len(spare) >= standby:
            return []
        return self._layout(
            zone, len(rotation) + standby, len(rotation), f"{reason}: standby {standby}"
        )

    # --- steps ----------------------------------------------------------------------------

    def _names(self, zone: str, count: int) -> list[str]:
        return [instance_name(self.kind, zone, index, self.pool) for index in range(count)]

    def _layout(self, zone: str, total: int, rotation: int, action: str) -> list[str]:
        """One fleet change: `total` replicas of the kind in `zone`, the first `rotation` of
        them in rotation. The names the change adds."""
        live = self.manager.live_spec()
        counts = dict(live.replicas_of(self.kind, self.pool).per_zone)
        before = counts.get(zone, 0)
        counts[zone] = total
        names = self._names(zone, total)
        others = [n for n in live.fleet.standby if not self._in_pool(live, n, zone)]
        fleet = live.fleet.model_dump()
        if self.kind == "model":
            fleet["model_pools"] = {**fleet["model_pools"], self.pool: counts}
        else:
            fleet["pools"] = {**fleet["pools"], self.kind: counts}
        fleet["standby"] = others + names[rotation:]
        changed = FleetState.model_validate(fleet)
        if changed == live.fleet:
            return []
        proposed = resolve(live.model_copy(update={"fleet": changed}))
        what = scaled_pool_label(self.kind, self.pool)
        line = f"{what} {zone}: {before} -> {total}, {rotation} in rotation"
        self.manager.swap(live, proposed, f"scale: {action}", changes=[line])
        return names[before:]

    def _in_pool(self, spec: ResolvedSpec, name: str, zone: str) -> bool:
        return any(
            i.name == name
            and i.zone == zone
            and i.service == self.kind
            and (self.kind != "model" or i.pool == self.pool)
            for i in spec.instances()
        )

    def _until(self, what: str, timeout_s: float, done: Callable[[], bool]) -> None:
        give_up = self.clock() + timeout_s
        while not done():
            if self.clock() > give_up:
                raise ScaleError(f"{what}: not within {timeout_s:g} s")
            self.sleep(self.poll_s)

    def _warm(self, spec: ResolvedSpec, names: list[str]) -> list[str]:
        """Those of `names` that are ready now: their own health SERVING, and for a model
        server that of every version it serves too."""

        def health(name: str) -> list[str]:
            return served_health_names(spec, name) if self.kind == "model" else [""]

        return [n for n in names if all(version_health(spec, n, health(n)).values())]

    def _wait_ready(self, names: list[str]) -> None:
        """Until the mesh started each of `names` and each holds every version SERVING."""
        if not names:
            return
        state_dir = self.manager.paths.state_dir
        self._until(
            f"the mesh did not start {', '.join(names)} (is `servemesh up` running?)",
            self.ready_timeout_s,
            lambda: all(fleet_status(state_dir).get(n, {}).get("pid") for n in names),
        )
        pending = set(names)

        def ready() -> bool:
            live = self.manager.live_spec()
            pending.difference_update(self._warm(live, sorted(pending)))
            return not pending

        self._until(
            f"{', '.join(sorted(pending))} did not become ready (health SERVING)",
            self.ready_timeout_s,
            ready,
        )

    def _hosts(self, spec: ResolvedSpec, names: list[str]) -> dict[str, list[tuple[str, str]]]:
        """Each replica's (cluster, host:port) entries in Envoy: a model server's in every
        version's clusters, a feature service's in every zone's feature cluster, a gateway's
        in the edge's gateway cluster (not its streams cluster: a Watch stream lasts up to
        a minute, and a draining gateway's stop ends what is left of them)."""
        found: dict[str, list[tuple[str, str]]] = {}
        for name in names:
            address = f"{spec.host_of(name)}:{spec.port_of(name)}"
            if self.kind == "gateway":
                clusters = [GATEWAY_CLUSTER]
            elif self.kind == "feature":
                clusters = [feature_cluster(zone) for zone in spec.zones]
            else:
                clusters = clusters_listing(spec, name)
            found[name] = [(cluster, address) for cluster in clusters]
        return found

    def _wait_envoy(self, names: list[str]) -> None:
        """Until Envoy counts each of `names` healthy in every cluster that lists it."""
        if not names:
            return
        hosts = self._hosts(self.manager.live_spec(), names)

        def healthy() -> bool:
            try:
                views = envoy_hosts(self.manager)
            except (AdminError, OSError, ValueError):
                return False
            return all(
                (state := views.get(cluster, {}).get(address)) is not None and state.healthy
                for entries in hosts.values()
                for cluster, address in entries
            )

        self._until("Envoy did not count the new replicas healthy", self.ready_timeout_s, healthy)

    def _wait_drained(self, names: list[str]) -> None:
        """Until Envoy has no call open to any of `names`, or `drain_timeout_s` passed (the
        replica's own drain on SIGTERM then finishes what is left)."""
        if not names:
            return
        hosts = self._hosts(self.manager.live_spec(), names)

        def drained() -> bool:
            try:
                views = envoy_hosts(self.manager)
            except (AdminError, OSError, ValueError):
                return False
            return all(
                views.get(cluster, {}).get(address) is None
                or views[cluster][address].in_flight == 0
                for entries in hosts.values()
                for cluster, address in entries
            )

        try:
            self._until("calls in flight", self.drain_timeout_s, drained)
        except ScaleError:
            log.warning("scale: %s still had calls after the drain timeout", ", ".join(names))
