"""The scaler's round: read every pool's signals in every zone, decide, act, record.

`Scaler.round()` is one round, with the clocks injected; `run()` repeats it every
`scaling.interval` until stopped. The running spec is read again each round, so an `apply`
of a new policy takes effect at the next one. While a blue-green or rolling update changes
the fleet the scaler holds (and says so in its status): two writers of one fleet would undo
each other's steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from servemesh.observe.scrape import Sample, scrape
from servemesh.proxy.apply import RouteManager
from servemesh.scaling.actuator import PoolActuator, ScaleError, busy_with_an_update, zone_replicas
from servemesh.scaling.blame import Hop, blame, hop_shares
from servemesh.scaling.decide import Decision, PoolSignals, Stabilizer, decide
from servemesh.scaling.edge import EdgeReader, EdgeSignals, admin_fetch
from servemesh.scaling.forecast import Forecast, forecast, replica_capacity
from servemesh.scaling.history import record, write_status
from servemesh.scaling.host import HostLoad, HostReader
from servemesh.scaling.metrics import ScalerMetrics
from servemesh.scaling.signals import SERVING_METHODS, PoolReader
from servemesh.spec import ResolvedSpec, ScaledKind, scaled_pool_label
from servemesh.spec.scaling_policy import DEFAULT_CAPACITY_RPS

# The wait between rounds while the live spec cannot be read (the last interval read is
# kept once there was one).
FALLBACK_INTERVAL_S = 5.0
# How often the forecast's history (the prediction log's calls per hour) is read again.
HISTORY_REFRESH_S = 300.0

log = logging.getLogger(__name__)


def _wall() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Objective:
    """What the caller is promised at the edge: the scaling.edge objective, or a stricter
    one of `rollout.slos`."""

    p99_ms: float
    error_ratio: float

    @classmethod
    def of(cls, live: ResolvedSpec) -> Objective:
        edge = live.scaling.edge
        slos = list(live.rollout.slos.values())
        p99 = min([edge.p99_ms, *(s.p99_ms for s in slos)])
        errors = min([edge.error_ratio, *(1 - s.availability for s in slos)])
        return cls(p99, errors)

    def breach(self, seen: EdgeSignals) -> str | None:
        """The breach in words, None when `seen` meets the objective."""
        if seen.p99_ms is not None and seen.p99_ms > self.p99_ms:
            return f"edge p99 {seen.p99_ms:.0f} ms > {self.p99_ms:g} ms"
        if seen.error_ratio is not None and seen.error_ratio > self.error_ratio:
            return f"edge errors {seen.error_ratio:.2%} > {self.error_ratio:.2%}"
        return None


@dataclass
class EdgeWatch:
    """One zone's edge: since when it breaches, and the hop shares of its last interval
    within the objective (the baseline a breach is compared with)."""

    breaching_since: float | None = None
    baseline: dict[str, float] | None = None
    last_p99_ms: float | None = None  # the last interval's, when it had one


@dataclass(frozen=True)
class _Read:
    """One pool's zone as read this round."""

    kind: ScaledKind
    pool_name: str
    rotation: list[str]
    standby: list[str]
    signals: PoolSignals


@dataclass
class Scaler:
    manager: RouteManager
    scrape: Callable[[str], list[Sample]] = scrape
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], datetime] = _wall
    # The actuator of each pool, by its label (`scaled_pool_label`: `model-fraud`,
    # `gateway`; tests inject their own); missing: a real one.
    actuators: dict[str, PoolActuator] | None = None
    # Calls per hour, for the forecast: the prediction log's when None.
    hourly: Callable[[ResolvedSpec, float], list[tuple[datetime, int]]] | None = None
    metrics: ScalerMetrics = field(default_factory=ScalerMetrics)
    host: HostReader = field(default_factory=HostReader)
    # How an edge Envoy's admin API is read, by its socket path (tests inject their own).
    edge_fetch: Callable[[Path], Callable[[str], str]] = admin_fetch
    _edge_readers: dict[str, EdgeReader] = field(default_factory=dict, init=False)  # by proxy
    _edge_watches: dict[str, EdgeWatch] = field(default_factory=dict, init=False)
    # The pools and zones whose last decision was held for want of headroom (recorded once
    # per stretch).
    _starved: set[tuple[str, str]] = field(default_factory=set, init=False)
    # By pool label and zone.
    _stabilizers: dict[tuple[str, str], Stabilizer] = field(default_factory=dict, init=False)
    # One reader per pool and zone: a reader forgets the replicas a read does not name.
    _readers: dict[tuple[str, str], PoolReader] = field(default_factory=dict, init=False)
    _history: tuple[float, list[tuple[datetime, int]]] | None = field(default=None, init=False)

    @property
    def state_dir(self) -> Path:
        return self.manager.paths.state_dir

    def round(self) -> list[Decision]:
        """Decide (and act) once for every pool's zones (each model pool first, then the
        gateways and the feature services); the decisions made."""
        live = self.manager.live_spec()
        policy = live.scaling
        if not policy.enabled:
            write_status(self.state_dir, {}, held="scaling.enabled is false")
            self.metrics.rounds.labels("held").inc()
            return []
        busy = busy_with_an_update(live)
        if busy:
            write_status(self.state_dir, {}, held=busy)
            self.metrics.rounds.labels("held").inc()
            return []
        host = self._read_host()
        guard = live.scaling.host
        starved = guard.enabled and host.saturated_at(guard.busy_ratio)
        self.metrics.observe_host(host, starved)
        saturated = host.describe() if starved else None
        reads = self._read_pools(live)
        demands, edges = self._edge_demands(live, reads)
        decisions: list[Decision] = []
        status: dict[str, dict[str, dict[str, Any]]] = {}
        for kind, pool_name in live.scaled_pools():
            found = self._pool_round(live, kind, pool_name, reads, demands, saturated)
            status[scaled_pool_label(kind, pool_name)] = {d.zone: entry for d, entry in found}
            decisions += [d for d, _ in found]
            if any(d.changes for d, _ in found):
                # The next pool reads the spec as these moves left it (ports, fleet).
                live = self.manager.live_spec()
        judged = {**host.as_dict(), "saturated": starved}  # by the spec's busy_ratio
        write_status(self.state_dir, status, host=judged, edges=edges)
        self.metrics.rounds.labels("ok").inc()
        return decisions

    def _read_host(self) -> HostLoad:
        try:
            load = self.host.read()
        except (OSError, ValueError) as exc:  # no /proc: the host is not judged
            log.info("scale: host load not read: %s", exc)
            return HostLoad(1, None, 0)
        return load

    def _read_pools(self, live: ResolvedSpec) -> dict[tuple[str, str], _Read]:
        """Every pool's zones, read once a round (the edge's blame needs them all)."""
        reads: dict[tuple[str, str], _Read] = {}
        for kind, pool_name in live.scaled_pools():
            label = scaled_pool_label(kind, pool_name)
            for zone in live.scaled_zones(kind, pool_name):
                rotation, standby = zone_replicas(live, zone, kind, pool_name)
                reader = self._readers.get((label, zone))
                if reader is None:
                    reader = PoolReader(self.scrape, self.clock, SERVING_METHODS[kind])
                    self._readers[(label, zone)] = reader
                signals = reader.read({n: live.metrics_address_of(n) for n in rotation})
                reads[(label, zone)] = _Read(kind, pool_name, rotation, standby, signals)
        return reads

    def _read_edges(self, live: ResolvedSpec) -> dict[str, EdgeSignals | None]:
        """Predict at each zone's edge since the last round: every edge Envoy read once (a
        reader's interval starts at its own last read), a zone without an edge of its own
        given the first edge's; None where not measured."""
        from servemesh.proxy.admin import admin_socket_path

        edges = live.edge_proxies()
        by_proxy: dict[str, EdgeSignals | None] = {}
        for proxy in edges:
            reader = self._edge_readers.get(proxy)
            if reader is None:
                fetch = self.edge_fetch(admin_socket_path(self.state_dir, proxy))
                reader = self._edge_readers[proxy] = EdgeReader(fetch, self.clock)
            try:
                by_proxy[proxy] = reader.read()
            except (OSError, ValueError) as exc:
                log.info("scale: edge %s not read: %s", proxy, exc)
                by_proxy[proxy] = None
        zones_edge = {live.zone_of_edge(proxy): proxy for proxy in edges}
        return {zone: by_proxy[zones_edge.get(zone, edges[0])] for zone in live.zones}

    def _edge_demands(
        self, live: ResolvedSpec, reads: dict[tuple[str, str], _Read]
    ) -> tuple[dict[tuple[str, str], tuple[int, str]], dict[str, dict[str, Any]]]:
        """Per zone, the pool the edge's breach asks to grow (by label and zone: the size
        asked and why), and what each zone's edge showed."""
        demands: dict[tuple[str, str], tuple[int, str]] = {}
        shown: dict[str, dict[str, Any]] = {}
        if not live.scaling.edge.enabled:
            return demands, shown
        objective = Objective.of(live)
        for zone, seen in self._read_edges(live).items():
            if seen is None:
                continue
            self.metrics.observe_edge(zone, seen)
            hops = {
                label: Hop(
                    label,
                    read.kind,
                    read.signals.p99_ms,
                    read.signals.replicas < live.scaling.pool(read.kind).max,
                )
                for (label, where), read in reads.items()
                if where == zone
            }
            shares = hop_shares(seen.p99_ms or 0.0, hops)
            watch = self._edge_watches.setdefault(zone, EdgeWatch())
            breach = objective.breach(seen)
            now = self.clock()
            if seen.p99_ms is not None:
                watch.last_p99_ms = seen.p99_ms
            entry: dict[str, Any] = {
                **seen.as_dict(),
                "objective_p99_ms": objective.p99_ms,
                "objective_error_ratio": objective.error_ratio,
                "shares": {label: round(share, 2) for label, share in shares.items()},
                "breach": breach or "",
            }
            shown[zone] = entry
            if breach is None:
                # Envoy merges its histograms every 5 s: an interval without a p99 is not
                # known to be within the objective, and neither ends a breach nor starts one.
                if seen.p99_ms is not None:
                    watch.breaching_since = None
                    watch.baseline = shares
                continue
            if watch.breaching_since is None:
                watch.breaching_since = now
            chosen = blame(shares, watch.baseline, hops)
            if chosen is None:
                entry["blamed"] = "every pool at its max"
                continue
            read = reads[(chosen.label, zone)]
            window = live.scaling.pool(read.kind)
            lasted = now - watch.breaching_since
            entry["blamed"] = chosen.label
            if lasted < window.up_window_s:
                continue  # a spike shorter than the pool's up-window is ridden out
            want = read.signals.replicas + window.step_up
            demands[(chosen.label, zone)] = (
                want,
                f"{breach} over {window.up_window}; {chosen.why}",
            )
        return demands, shown

    def _pool_round(
        self,
        live: ResolvedSpec,
        kind: ScaledKind,
        pool_name: str,
        reads: dict[tuple[str, str], _Read],
        demands: dict[tuple[str, str], tuple[int, str]],
        saturated: str | None,
    ) -> list[tuple[Decision, dict[str, Any]]]:
        """One round for one pool (a kind's; model servers: the model pool `pool_name`) in
        every zone it has replicas in."""
        scaling = live.scaling
        pool = scaling.pool(kind)
        label = scaled_pool_label(kind, pool_name)
        actuator = (self.actuators or {}).get(label) or PoolActuator(
            self.manager,
            scaling.ready_timeout_s,
            scaling.drain_timeout_s,
            kind=kind,
            pool=pool_name,
        )
        zones = live.scaled_zones(kind, pool_name)
        predicted = self.predicted_floor(live, len(zones), kind)
        found: list[tuple[Decision, dict[str, Any]]] = []
        for zone in zones:
            read = reads.get((label, zone))
            if read is None:  # a zone a move of an earlier pool this round brought
                continue
            rotation, standby, signals = read.rotation, read.standby, read.signals
            stabilizer = self._stabilizers.setdefault((label, zone), Stabilizer())
            found_now = decide(
                zone, pool, signals, stabilizer, self.clock(), self.wall(), predicted,
                demand=demands.get((label, zone)), saturated=saturated,
                keep=self._kept_for_the_edge(live, zone, pool.down_below),
            )  # fmt: skip
            decision = replace(found_now, pool=label)
            self._note_starved(decision)
            self.metrics.observe(decision, len(rotation), len(standby))
            entry: dict[str, Any] = {
                "in_rotation": rotation,
                "standby": standby,
                "signals": signals.as_dict(),
                "floor": decision.floor,
                "decision": decision.line(),
                "signal": decision.signal,
            }
            if decision.changes:
                entry["outcome"] = self._act(actuator, decision, pool.standby)
                stabilizer.changed(self.clock())
            elif len(standby) < pool.standby:
                try:
                    actuator.keep_standby(zone, pool.standby)
                except ScaleError as exc:
                    log.warning("scale: %s %s standby: %s", label, zone, exc)
            found.append((decision, entry))
        return found

    def _kept_for_the_edge(self, live: ResolvedSpec, zone: str, down_below: float) -> str | None:
        """Why no pool of `zone` may shrink: its edge's last p99 above `down_below` of the
        objective (None when the edge signal is off or the edge is quiet enough)."""
        watch = self._edge_watches.get(zone)
        if not live.scaling.edge.enabled or watch is None or watch.last_p99_ms is None:
            return None
        objective = Objective.of(live).p99_ms
        if watch.last_p99_ms <= objective * down_below:
            return None
        return f"edge p99 {watch.last_p99_ms:.0f} ms above {down_below:.0%} of {objective:g} ms"

    def _note_starved(self, decision: Decision) -> None:
        """A decision held for want of headroom goes to the history once per stretch (and
        to the metrics every round), so `scale history` says why nothing grew."""
        key = (decision.pool, decision.zone)
        if not decision.held.startswith("no headroom"):
            self._starved.discard(key)
            return
        self.metrics.starved.labels(decision.pool, decision.zone).inc()
        if key not in self._starved:
            self._starved.add(key)
            log.warning("scale: %s", decision.line())
            record(self.state_dir, decision, "held")

    def forecast(self, live: ResolvedSpec, at: datetime) -> Forecast:
        """The rate expected at `at` from the history the policy's forecast reads."""
        from zoneinfo import ZoneInfo

        pool = live.scaling.model_servers
        now = self.wall()
        cached = self._history
        if cached is None or self.clock() - cached[0] > HISTORY_REFRESH_S:
            span = pool.forecast.weeks * 7 * 86400.0
            read = self.hourly or logged_hours
            cached = self._history = (self.clock(), read(live, span))
        return forecast(cached[1], at, now, ZoneInfo(pool.schedule.timezone))

    def predicted_floor(
        self, live: ResolvedSpec, zones: int, kind: ScaledKind = "model"
    ) -> tuple[int, str] | None:
        """The forecast's floor per zone of a kind's pool and why, when its policy
        forecasts."""
        pool = live.scaling.pool(kind)
        if not pool.forecast.enabled or not zones:
            return None
        at = self.wall() + timedelta(seconds=pool.forecast.lead_s)
        try:
            expected = self.forecast(live, at)
        except (OSError, ValueError) as exc:  # no log yet, or one being replaced
            log.info("scale: no forecast: %s", exc)
            return None
        if kind == "model":
            capacity, _source = replica_capacity(live, self.state_dir)
        else:  # a capacity plan measures model servers: the pool's own figure, else the default
            capacity = pool.forecast.capacity_rps or DEFAULT_CAPACITY_RPS
        replicas = expected.replicas(zones, capacity)
        why = (
            f"forecast {expected.rps:.0f} req/s at {at:%H:%M} UTC (lead {pool.forecast.lead}, "
            f"{capacity:g} per replica)"
        )
        return replicas, why

    def _act(self, actuator: PoolActuator, decision: Decision, standby: int) -> str:
        started = self.clock()
        log.info("scale: %s", decision.line())
        try:
            if decision.desired > decision.current:
                actuator.grow(decision.zone, decision.desired, standby, decision.reason)
            else:
                actuator.shrink(decision.zone, decision.desired, standby, decision.reason)
        except (ScaleError, OSError, ValueError) as exc:
            outcome = f"failed: {exc}"
            log.warning("scale: %s %s", decision.zone, outcome)
        else:
            outcome = "done"
        record(self.state_dir, decision, outcome, seconds=self.clock() - started)
        self.metrics.acted(decision, outcome)
        return outcome

    def run(self, stop: threading.Event) -> None:
        """Rounds every `scaling.interval` until `stop` is set."""
        interval = FALLBACK_INTERVAL_S
        while not stop.is_set():
            started = self.clock()
            try:
                interval = self.manager.live_spec().scaling.interval_s
                self.round()
            except Exception:  # one bad round (a spec mid-rewrite, a scrape) is not the end
                log.exception("scale: the round failed")
                self.metrics.rounds.labels("failed").inc()
            stop.wait(max(0.0, interval - (self.clock() - started)))


def logged_hours(spec: ResolvedSpec, span_s: float) -> list[tuple[datetime, int]]:
    """Calls per UTC hour over the last `span_s`, from the mesh's prediction log."""
    from servemesh.predlog.query import reader_for

    return reader_for(spec.prediction_log, spec.state_dir).hourly_calls(span_s)
