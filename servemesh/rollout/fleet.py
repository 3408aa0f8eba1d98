"""Blue-green and rolling updates: the model servers themselves change, not only the split.

Both work through the running spec's `fleet` (servemesh.spec.FleetState), which the mesh's
own process (`servemesh up`, the launcher) follows: it starts the replicas a change adds,
restarts those whose generation went up and stops those it drops, by PID, and writes what
it started to `<state_dir>/fleet-status.json`. This module, in the rollout's process, only
changes the spec through the route manager (validated, swapped, confirmed, recorded in
`routes history`) and waits for what it needs: the replicas' own health, and Envoy's view.

- **Blue-green** (`run_blue_green`): a second set of model servers ("green") starts in the
  model's pool only, as many per zone as the pool has, loads every version of the pool and
  warms up; the new version's clusters list the green replicas only. Other pools start and
  stop nothing, and updates of different pools may run side by side. Once every green
  replica reports the version SERVING and Envoy counts every one of them healthy, one route
  change gives the version 100%. The old set ("blue") keeps serving the baseline, so
  switching back is one route change too (`servemesh rollout abort`, `servemesh routes
  set`, or a failed check). After the rollout is promoted and confirmed, `retire_old_set`
  (`servemesh fleet retire`) makes the green replicas the pool's own (`fleet.homes`) and
  stops the pool's blue replicas.
- **Rolling** (`run_rolling`): every model server is replaced in turn: its endpoints are
  marked draining (Envoy sends it no new call), its calls in flight finish (Envoy's
  `rq_active` for it reaches 0), the mesh stops it by PID and starts a new process, which
  loads the spec (the new version with it); once it reports every version SERVING it is
  put back, and Envoy has to count it healthy before the next one goes. When every replica
  is new, one route change gives the version 100%.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2

from servemesh.contract.errors import ServemeshError
from servemesh.contract.wire import model_cluster, version_health_name
from servemesh.proxy.admin import AdminError
from servemesh.proxy.apply import ApplyResult, RouteManager
from servemesh.proxy.replicas import (
    clusters_listing,
    envoy_hosts,
    served_health_names,
    version_health,
)
from servemesh.rollout.types import Ending, Outcome
from servemesh.spec import FLEET_STATUS_FILE, FleetState, ReplicaSet, ResolvedSpec, resolve
from servemesh.spec.rollout_plan import RolloutPlan
from servemesh.state.paths import ApplyError

log = logging.getLogger(__name__)

# The names a blue-green update gives its new set: whichever the first set is not.
SET_NAMES = ("green", "blue")

SERVING = health_pb2.HealthCheckResponse.SERVING

# Markers recorded after each durable step (ctx.record); a resumed update reads the live
# spec to see what is done, and the marker for what a crash may have left half-way.
GREEN_STARTED = "blue-green:green-started"
GREEN_READY = "blue-green:green-ready"
SWITCHED = "blue-green:switched"
SWITCHED_BACK = "blue-green:switched-back"
ROLLING_DRAINING = "rolling:draining"
ROLLING_RENEWING = "rolling:renewing"
ROLLING_REPLACED = "rolling:replaced"
ROLLING_SWITCHED = "rolling:switched"


class FleetError(ServemeshError, RuntimeError):
    """A blue-green or rolling update cannot go on; the message says what and where."""


class _Stopped(Exception):
    """ctx.should_stop() asked for a stop (abort, pause); the reason."""


def _never() -> str | None:
    return None


def _nothing(marker: str, data: dict[str, Any]) -> None:
    return None


@dataclass
class StrategyContext:
    """What the rollout controller hands a fleet strategy."""

    manager: RouteManager
    spec: ResolvedSpec
    model: str
    version: str
    baseline: str
    plan: RolloutPlan
    say: Callable[[str], None] = print
    # A durable step marker (one of the constants above, some with ":<instance>") and its
    # data; the controller persists it, and hands the last one back as `resume_from`.
    record: Callable[[str, dict[str, Any]], None] = _nothing
    resume_from: str | None = None
    # An abort or pause asked for (its reason), checked between steps and while waiting.
    should_stop: Callable[[], str | None] = _never
    # The controller's analysis once the new version takes all traffic: an Ending (rolled
    # back, naming the failed check) when it failed, None when it held. Without one the
    # update is promoted as soon as the switch is confirmed.
    watch: Callable[[], Ending | None] | None = None
    # How long a new replica may take to start, load and warm every version.
    ready_timeout_s: float = 300.0
    # How long a draining replica's calls in flight may take before it is stopped anyway
    # (its own drain on SIGTERM then lets them finish within its grace period).
    drain_timeout_s: float = 30.0
    poll_s: float = 0.1
    _clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    @property
    def state_dir(self) -> Path:
        return self.manager.paths.state_dir


# --- reading the mesh -----------------------------------------------------------------------


def fleet_status(state_dir: Path, kind: str | None = None) -> dict[str, dict[str, Any]]:
    """What the running mesh says it started, by instance: {"service", "generation", "pid",
    "state", "restarts", "last_exit"} ({} when it wrote nothing yet); with `kind`, only the
    replicas of that service. `restarts`: times the mesh started it again after it exited
    unexpectedly; `state`: running, restarting, held (killed on purpose), exited."""
    instances = _status_section(state_dir, "instances")
    if kind is None:
        return instances
    return {n: e for n, e in instances.items() if isinstance(e, dict) and e.get("service") == kind}


def mesh_processes_status(state_dir: Path) -> dict[str, dict[str, Any]]:
    """The running mesh's other processes it starts again when they crash (the registry,
    the trace store, the per-zone layout's Envoys), by name, as fleet_status describes
    its replicas (no generation)."""
    return _status_section(state_dir, "processes")


def _status_section(state_dir: Path, section: str) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads((Path(state_dir) / FLEET_STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    found = data.get(section, {}) if isinstance(data, dict) else {}
    return found if isinstance(found, dict) else {}


def _supported(spec: ResolvedSpec) -> None:
    if spec.discovery.backend != "file":
        raise FleetError(
            "discovery.backend: blue-green and rolling updates start replicas from the "
            f"running mesh, and need the 'file' backend (this mesh uses {spec.discovery.backend!r})"
        )
    if spec.network.mode == "netns":
        raise FleetError(
            "network.mode: blue-green and rolling updates cannot add replicas to zones in "
            "network namespaces (their ports are joined at start)"
        )


def _address(spec: ResolvedSpec, instance: str) -> str:
    return f"{spec.host_of(instance)}:{spec.port_of(instance)}"


# --- waiting ----------------------------------------------------------------------------------


def _wait(ctx: StrategyContext, what: str, timeout_s: float, done: Callable[[], bool]) -> None:
    """Until `done()`; FleetError naming `what` after `timeout_s`, _Stopped when asked to."""
    give_up = ctx._clock() + timeout_s
    while not done():
        reason = ctx.should_stop()
        if reason:
            raise _Stopped(reason)
        if ctx._clock() > give_up:
            raise FleetError(f"{what}: not within {timeout_s:g} s")
        time.sleep(ctx.poll_s)


def _wait_started(
    ctx: StrategyContext, generations: Mapping[str, int], old_pids: Mapping[str, int | None]
) -> None:
    """Until the mesh reports each instance started at its generation, by a new PID."""

    def started() -> bool:
        status = fleet_status(ctx.state_dir)
        for name, generation in generations.items():
            entry = status.get(name)
            if entry is None or entry.get("generation") != generation or not entry.get("pid"):
                return False
            if old_pids.get(name) is not None and entry.get("pid") == old_pids[name]:
                return False
        return True

    names = ", ".join(generations)
    _wait(
        ctx,
        f"the mesh did not start {names} (is `servemesh up` running from "
        f"{ctx.state_dir}? its log: {ctx.state_dir / 'logs'})",
        ctx.ready_timeout_s,
        started,
    )


def _wait_serving(
    ctx: StrategyContext, spec: ResolvedSpec, names: list[str], health: list[str] | None = None
) -> None:
    """Until every model server in `names` reports each name of `health` SERVING; None:
    what it serves (its own health and its pool's versions: `served_health_names`)."""
    pending = set(names)

    def serving() -> bool:
        for name in sorted(pending):
            wanted = health if health is not None else served_health_names(spec, name)
            if all(version_health(spec, name, wanted).values()):
                pending.discard(name)
        return not pending

    try:
        _wait(ctx, "replicas not SERVING", ctx.ready_timeout_s, serving)
    except FleetError:
        logs = ", ".join(str(ctx.state_dir / "logs" / f"{n}.log") for n in sorted(pending))
        raise FleetError(
            f"{', '.join(sorted(pending))} did not report "
            f"{', '.join(health) if health is not None else 'every version they serve'} "
            f"SERVING within {ctx.ready_timeout_s:g} s; see {logs}"
        ) from None


def _wait_envoy(
    ctx: StrategyContext,
    what: str,
    spec: ResolvedSpec,
    instances: list[str],
    clusters_of: Callable[[str], list[str]],
    *,
    healthy: bool,
) -> None:
    """Until Envoy counts each instance healthy (or, healthy=False, not healthy: drained of
    new calls) in every cluster `clusters_of` names for it."""

    def holds() -> bool:
        try:
            views = envoy_hosts(ctx.manager)
        except (AdminError, OSError, ValueError):
            return False
        for name in instances:
            address = _address(spec, name)
            for cluster in clusters_of(name):
                host = views.get(cluster, {}).get(address)
                if healthy and (host is None or not host.healthy):
                    return False
                if not healthy and host is not None and host.healthy:
                    return False
        return True

    _wait(ctx, what, ctx.ready_timeout_s, holds)


def _in_flight(ctx: StrategyContext, spec: ResolvedSpec, instance: str) -> int:
    """Calls Envoy has open to `instance`, over every cluster listing it (every zone's)."""
    address = _address(spec, instance)
    try:
        views = envoy_hosts(ctx.manager)
    except (AdminError, OSError, ValueError):
        return -1  # unknown: not drained yet as far as anyone can tell
    return sum(hosts[address].in_flight for hosts in views.values() if address in hosts)


# --- changing the fleet -----------------------------------------------------------------------


def _with_fleet(live: ResolvedSpec, fleet: FleetState) -> ResolvedSpec:
    """The running spec with another fleet; replicas new to it get ports of their own."""
    return resolve(live.model_copy(update={"fleet": fleet}))


def _change_fleet(
    ctx: StrategyContext, fleet: FleetState, action: str, lines: list[str]
) -> ApplyResult:
    live = ctx.manager.live_spec()
    return ctx.manager.swap(live, _with_fleet(live, fleet), action, changes=lines)


def _weights(spec: ResolvedSpec, model: str) -> dict[str, int]:
    return dict(spec.models[model].traffic)


def _check_versions(ctx: StrategyContext, live: ResolvedSpec) -> None:
    model = live.models.get(ctx.model)
    if model is None:
        raise FleetError(f"model {ctx.model!r} is not served; models: {sorted(live.models)}")
    if ctx.version == ctx.baseline:
        raise FleetError(f"version: {ctx.version!r} is the baseline itself")
    for role, version in (("version", ctx.version), ("baseline", ctx.baseline)):
        if version not in model.versions:
            raise FleetError(
                f"{role}: model {ctx.model!r} has no version {version!r} in the running spec "
                f"(versions: {sorted(model.versions)}); add it first: servemesh apply FILE"
            )


def _switch(ctx: StrategyContext, to: str) -> ApplyResult:
    result = ctx.manager.set_weights(ctx.model, {to: 100}, who=None)
    ctx.say(
        f"{ctx.model}: {to} takes 100% (change #{result.entry_id}, "
        f"{result.confirm_ms:.0f} ms from swap to confirmed)"
    )
    return result


# --- blue-green -------------------------------------------------------------------------------


def run_blue_green(ctx: StrategyContext) -> Ending:
    """Bring the new version up on a second set of replicas, switch 0 -> 100 in one route
    change, and keep the old set for an instant switch back (see the module's doc)."""
    live = ctx.manager.live_spec()
    _supported(live)
    _check_versions(ctx, live)
    pool = live.pool_of(ctx.model)
    extra = live.fleet.sets_in(pool)
    serving_set = next((s for s in extra if ctx.version in s.serves.get(ctx.model, [])), None)
    if serving_set is None and extra:
        raise FleetError(
            f"fleet.sets: set {extra[0].name!r} of an earlier blue-green update of pool "
            f"{pool!r} is still up; retire the old set (servemesh fleet retire --pool {pool}) "
            "or abort that rollout first"
        )
    try:
        if serving_set is None:
            serving_set = _start_green(ctx, live)
        green = [i.name for i in ctx.manager.live_spec().set_replicas(serving_set.name, pool)]
        _warm_green(ctx, serving_set.name, green)
    except _Stopped as stop:
        _tear_down_green(ctx)
        return Ending(Outcome.ROLLED_BACK, f"stopped before the switch: {stop}")
    except (FleetError, ApplyError) as exc:
        _tear_down_green(ctx)
        return Ending(Outcome.ROLLED_BACK, f"the green set did not come up: {exc}")

    if _weights(ctx.manager.live_spec(), ctx.model).get(ctx.version) != 100:
        reason = ctx.should_stop()
        if reason:
            _tear_down_green(ctx)
            return Ending(Outcome.ROLLED_BACK, f"stopped before the switch: {reason}")
        result = _switch(ctx, ctx.version)
        ctx.record(SWITCHED, {"change": result.entry_id, "set": serving_set.name})

    ending = ctx.watch() if ctx.watch is not None else None
    reason = ctx.should_stop()
    if ending is None and reason:
        ending = Ending(Outcome.ROLLED_BACK, f"stopped: {reason}")
    if ending is not None and ending.outcome != Outcome.PROMOTED:
        # The old set never stopped serving the baseline: one route change back. Then the
        # new set goes: nothing routes to it, and a rejected version needs no warm standby.
        result = _switch(ctx, ctx.baseline)
        ctx.record(SWITCHED_BACK, {"change": result.entry_id})
        _tear_down_green(ctx)
        return ending
    blue = live.fleet.home_of(pool) or "first"
    return Ending(
        Outcome.PROMOTED,
        f"{ctx.model} {ctx.version} takes 100% on set {serving_set.name!r}; set {blue!r} "
        f"still serves {ctx.baseline} for a switch back until `servemesh fleet retire`",
    )


def _start_green(ctx: StrategyContext, live: ResolvedSpec) -> ReplicaSet:
    pool = live.pool_of(ctx.model)
    name = SET_NAMES[1] if live.fleet.home_of(pool) == SET_NAMES[0] else SET_NAMES[0]
    green = ReplicaSet(name=name, serves={ctx.model: [ctx.version]}, pools=[pool])
    fleet = live.fleet.model_copy(update={"sets": [*live.fleet.sets, green]})
    replicas = [i.name for i in _with_fleet(live, fleet).set_replicas(name, pool)]
    ctx.say(
        f"blue-green: starting set {name!r} for {ctx.model} {ctx.version}: {', '.join(replicas)}"
    )
    result = _change_fleet(
        ctx,
        fleet,
        f"blue-green {ctx.model} {ctx.version}: start set {name}",
        [f"+ replica set {name}: {', '.join(replicas)} (serves {ctx.model} {ctx.version})"],
    )
    ctx.record(GREEN_STARTED, {"set": name, "replicas": replicas, "change": result.entry_id})
    return green


def _warm_green(ctx: StrategyContext, set_name: str, green: list[str]) -> None:
    live = ctx.manager.live_spec()
    generations = {n: live.fleet.generations.get(n, 0) for n in green}
    _wait_started(ctx, generations, {})
    health = version_health_name(ctx.model, ctx.version)
    _wait_serving(ctx, live, green, [health])
    clusters = [model_cluster(ctx.model, ctx.version, zone) for zone in live.zones]
    _wait_envoy(
        ctx,
        f"Envoy did not count every replica of set {set_name!r} healthy for {ctx.model} "
        f"{ctx.version}",
        live,
        green,
        lambda _name: clusters,
        healthy=True,
    )
    pids = {n: fleet_status(ctx.state_dir).get(n, {}).get("pid") for n in green}
    ctx.say(
        f"blue-green: set {set_name!r} warm: {ctx.model} {ctx.version} SERVING on "
        + ", ".join(f"{n} (pid {pids[n]})" for n in green)
    )
    ctx.record(GREEN_READY, {"set": set_name, "pids": pids})


def _tear_down_green(ctx: StrategyContext, pool: str | None = None) -> None:
    """Drop the second set of the pool (the model's, without `pool`): its versions'
    clusters list the first set's replicas again, and the mesh stops its replicas. Only
    while no traffic goes to it."""
    live = ctx.manager.live_spec()
    pool = pool or live.pool_of(ctx.model)
    extra = live.fleet.sets_in(pool)
    if not extra:
        return
    dropped = extra[0]
    fleet = live.fleet.model_copy(update={"sets": [s for s in live.fleet.sets if s is not dropped]})
    _change_fleet(
        ctx,
        fleet,
        f"stop set {dropped.name} of pool {pool}"
        + (f" (blue-green {ctx.model} {ctx.version})" if ctx.model else ""),
        [f"- replica set {dropped.name} (pool {pool})"],
    )
    ctx.say(f"blue-green: set {dropped.name!r} of pool {pool!r} stopped")


def _taking_traffic(spec: ResolvedSpec, replica_set: ReplicaSet) -> list[str]:
    """The versions a set serves that have weight or are a shadow target ("model vN")."""
    found = []
    for model_name, versions in replica_set.serves.items():
        model = spec.models[model_name]
        for version in versions:
            shadowed = model.shadow is not None and model.shadow.version == version
            if model.traffic.get(version, 0) or shadowed:
                found.append(f"{model_name} {version}")
    return found


def second_set(live: ResolvedSpec, pool: str | None) -> tuple[str, ReplicaSet]:
    """The pool and second set a `fleet retire` or `discard` acts on: the one of `pool`, or,
    without one, the only second set there is."""
    if pool is not None:
        if pool not in live.pool_names():
            raise FleetError(f"--pool: no pool {pool!r}; pools: {live.pool_names()}")
        extra = live.fleet.sets_in(pool)
        if not extra:
            raise FleetError(f"fleet.sets: pool {pool!r} has no second set")
        return pool, extra[0]
    found = [(p, s) for p in live.pool_names() for s in live.fleet.sets_in(p)]
    if not found:
        raise FleetError("fleet.sets: there is no second set")
    if len(found) > 1:
        pools = ", ".join(p for p, _ in found)
        raise FleetError(f"fleet.sets: pools {pools} each have a second set; name one: --pool")
    return found[0]


def discard_new_set(
    manager: RouteManager, *, pool: str | None = None, say: Callable[[str], None] = print
) -> None:
    """Stop the second set of a blue-green update that was switched back (an abort whose
    controller had gone): its versions' clusters list the first set again. Refused while
    any version it serves takes traffic."""
    live = manager.live_spec()
    _supported(live)
    pool, extra = second_set(live, pool)
    busy = _taking_traffic(live, extra)
    if busy:
        raise FleetError(
            f"fleet.sets: set {extra.name!r} of pool {pool!r} still takes traffic for "
            f"{', '.join(busy)}; move it back first (servemesh routes set)"
        )
    ctx = StrategyContext(
        manager=manager, spec=live, model="", version="", baseline="", plan=RolloutPlan(), say=say
    )
    _tear_down_green(ctx, pool)


def retire_old_set(
    manager: RouteManager,
    *,
    pool: str | None = None,
    say: Callable[[str], None] = print,
    ready_timeout_s: float = 300.0,
    poll_s: float = 0.1,
) -> ApplyResult:
    """The explicit last step of a blue-green update, once it is promoted and confirmed:
    the second set's replicas become the pool's own (every version of the pool's clusters
    list them; `fleet.homes`), and the mesh stops the pool's old replicas. No switch back
    to the old set after this; other pools are not touched.

    Refused while a version only the old set serves still takes traffic (a switch back
    happened: tear the new set down instead by aborting)."""
    live = manager.live_spec()
    _supported(live)
    pool, new = second_set(live, pool)
    old_name = live.fleet.home_of(pool)
    ctx = StrategyContext(
        manager=manager,
        spec=live,
        model="",
        version="",
        baseline="",
        plan=RolloutPlan(),
        say=say,
        ready_timeout_s=ready_timeout_s,
        poll_s=poll_s,
    )
    served = {(m, v) for m, versions in new.serves.items() for v in versions}
    in_pool = {m: model for m, model in live.models.items() if live.pool_of(m) == pool}
    for model_name, model in in_pool.items():
        for version, weight in model.traffic.items():
            if weight and (model_name, version) not in served:
                raise FleetError(
                    f"models.{model_name}.traffic: {version} still takes {weight}% on set "
                    f"{old_name or 'first'!r}; move its weight to the new set's version first"
                )
    replicas = [i.name for i in live.set_replicas(new.name, pool)]
    # Every version of the pool, not only the new one: after this the new set serves them.
    _wait_serving(ctx, live, replicas)
    everything = {m: sorted(model.versions) for m, model in in_pool.items()}
    taking_over = new.model_copy(update={"serves": everything})
    step = live.fleet.model_copy(
        update={"sets": [taking_over if s is new else s for s in live.fleet.sets]}
    )
    manager.swap(
        live,
        _with_fleet(live, step),
        f"retire set {old_name or 'first'} of pool {pool}: set {new.name} serves every version",
        changes=[f"~ replica set {new.name} (pool {pool}): serves every version of the pool"],
    )
    _wait_envoy(
        ctx,
        f"Envoy did not count every replica of set {new.name!r} healthy in every cluster",
        live,
        replicas,
        lambda name: clusters_listing(_with_fleet(live, step), name),
        healthy=True,
    )
    old_replicas = [i.name for i in live.set_replicas(old_name, pool)]
    final = manager.live_spec()
    retired = final.fleet.model_copy(
        update={
            "sets": [
                s for s in final.fleet.sets if not (s.name == new.name and s.pools == new.pools)
            ],
            "homes": {**final.fleet.homes, pool: new.name},
        }
    )
    result = manager.swap(
        final,
        _with_fleet(final, retired),
        f"retire set {old_name or 'first'} of pool {pool}",
        changes=[f"- replica set {old_name or 'first'} (pool {pool}): {', '.join(old_replicas)}"],
    )
    say(f"fleet: pool {pool!r} runs on set {new.name!r} now; stopping {', '.join(old_replicas)}")
    _wait(
        ctx,
        f"the mesh did not stop {', '.join(old_replicas)}",
        ready_timeout_s,
        lambda: not (set(old_replicas) & set(fleet_status(manager.paths.state_dir))),
    )
    return result


# --- rolling ----------------------------------------------------------------------------------


def run_rolling(ctx: StrategyContext) -> Ending:
    """Replace every model server of the model's pool in turn, draining each first; then
    give the version 100% in one route change (see the module's doc)."""
    live = ctx.manager.live_spec()
    _supported(live)
    _check_versions(ctx, live)
    # The model's own pool only: the other pools' servers hold none of its versions.
    pool = live.pool_of(ctx.model)
    extra = live.fleet.sets_in(pool)
    if extra:
        raise FleetError(
            f"fleet.sets: set {extra[0].name!r} of a blue-green update of pool {pool!r} is "
            f"up; retire the old set (servemesh fleet retire --pool {pool}) or abort that "
            "rollout first"
        )
    replicas = [i.name for i in live.set_replicas(live.fleet.home_of(pool), pool)]
    if len(replicas) < 2:
        raise FleetError(
            f"pools.{pool}.per_zone: a rolling update takes one replica out at a time and "
            f"needs at least two; pool {pool} has {len(replicas)} (use --strategy blue-green)"
        )
    done = _rolled_before(ctx, replicas)
    for name in replicas:
        if name in done:
            continue
        try:
            _replace(ctx, name, resumed=ctx.resume_from == f"{ROLLING_RENEWING}:{name}")
        except _Stopped as stop:
            _undrain(ctx, name)
            return Ending(Outcome.ROLLED_BACK, f"stopped at {name}: {stop}")
        except (FleetError, ApplyError) as exc:
            _undrain(ctx, name)
            return Ending(Outcome.ROLLED_BACK, f"replacing {name} failed: {exc}")
        reason = ctx.should_stop()
        if reason:
            return Ending(Outcome.ROLLED_BACK, f"stopped after {name}: {reason}")

    if _weights(ctx.manager.live_spec(), ctx.model).get(ctx.version) != 100:
        result = _switch(ctx, ctx.version)
        ctx.record(ROLLING_SWITCHED, {"change": result.entry_id})
    ending = ctx.watch() if ctx.watch is not None else None
    reason = ctx.should_stop()
    if ending is None and reason:
        ending = Ending(Outcome.ROLLED_BACK, f"stopped: {reason}")
    if ending is not None and ending.outcome != Outcome.PROMOTED:
        _switch(ctx, ctx.baseline)
        return ending
    return Ending(
        Outcome.PROMOTED,
        f"{len(replicas)} model servers replaced one at a time; {ctx.model} {ctx.version} "
        "takes 100%",
    )


def _rolled_before(ctx: StrategyContext, replicas: list[str]) -> set[str]:
    """Replicas a resumed update already replaced: those before the recorded one, and it
    too once its replacement finished (all of them once the switch was recorded)."""
    marker = ctx.resume_from or ""
    if marker == ROLLING_SWITCHED:
        return set(replicas)
    for prefix, inclusive in (
        (ROLLING_REPLACED, True),
        (ROLLING_RENEWING, False),
        (ROLLING_DRAINING, False),
    ):
        if marker.startswith(prefix + ":"):
            name = marker[len(prefix) + 1 :]
            if name in replicas:
                at = replicas.index(name)
                return set(replicas[: at + 1 if inclusive else at])
    return set()


def _replace(ctx: StrategyContext, name: str, *, resumed: bool) -> None:
    live = ctx.manager.live_spec()
    clusters = clusters_listing(live, name)
    if not resumed:
        # 1. Out of rotation: Envoy is told the replica drains; it sends it no new call.
        if name not in live.fleet.draining:
            fleet = live.fleet.model_copy(update={"draining": [*live.fleet.draining, name]})
            _change_fleet(ctx, fleet, f"rolling: drain {name}", [f"~ {name}: draining"])
        ctx.record(f"{ROLLING_DRAINING}:{name}", {})
        _wait_envoy(
            ctx,
            f"Envoy still sends new calls to {name}",
            live,
            [name],
            lambda _n: clusters,
            healthy=False,
        )
        # 2. Its calls in flight finish (Envoy's own count of them).
        try:
            _wait(
                ctx,
                f"{name} calls in flight",
                ctx.drain_timeout_s,
                lambda: _in_flight(ctx, live, name) == 0,
            )
        except FleetError:
            log.warning("%s still has calls in flight; its own drain finishes them", name)
    # 3. Replaced: the mesh stops it by PID (SIGTERM, drain) and starts a new process.
    live = ctx.manager.live_spec()
    old_pid = fleet_status(ctx.state_dir).get(name, {}).get("pid")
    generation = live.fleet.generations.get(name, 0)
    if not resumed:
        generation += 1
        fleet = live.fleet.model_copy(
            update={"generations": {**live.fleet.generations, name: generation}}
        )
        _change_fleet(ctx, fleet, f"rolling: replace {name}", [f"~ {name}: replaced"])
        ctx.record(f"{ROLLING_RENEWING}:{name}", {"old_pid": old_pid})
    _wait_started(ctx, {name: generation}, {name: old_pid} if not resumed else {})
    # 4. The new process holds every version, warmed up, before it takes calls again.
    _wait_serving(ctx, live, [name])
    _undrain(ctx, name)
    _wait_envoy(
        ctx,
        f"Envoy did not count {name} healthy again",
        live,
        [name],
        lambda _n: clusters,
        healthy=True,
    )
    new_pid = fleet_status(ctx.state_dir).get(name, {}).get("pid")
    ctx.say(f"rolling: {name} replaced (pid {old_pid} -> {new_pid}) and back in rotation")
    ctx.record(f"{ROLLING_REPLACED}:{name}", {"pid": new_pid})


def _undrain(ctx: StrategyContext, name: str) -> None:
    live = ctx.manager.live_spec()
    if name not in live.fleet.draining:
        return
    fleet = live.fleet.model_copy(
        update={"draining": [n for n in live.fleet.draining if n != name]}
    )
    _change_fleet(ctx, fleet, f"rolling: {name} back", [f"~ {name}: in rotation"])
