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
from servemesh.scaling.decide import Decision, Stabilizer, decide
from servemesh.scaling.forecast import Forecast, forecast, replica_capacity
from servemesh.scaling.history import record, write_status
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
        decisions: list[Decision] = []
        status: dict[str, dict[str, dict[str, Any]]] = {}
        for kind, pool_name in live.scaled_pools():
            found = self._pool_round(live, kind, pool_name)
            status[scaled_pool_label(kind, pool_name)] = {d.zone: entry for d, entry in found}
            decisions += [d for d, _ in found]
            if any(d.changes for d, _ in found):
                # The next pool reads the spec as these moves left it (ports, fleet).
                live = self.manager.live_spec()
        write_status(self.state_dir, status)
        self.metrics.rounds.labels("ok").inc()
        return decisions

    def _pool_round(
        self, live: ResolvedSpec, kind: ScaledKind, pool_name: str = ""
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
            rotation, standby = zone_replicas(live, zone, kind, pool_name)
            reader = self._readers.get((label, zone))
            if reader is None:
                reader = PoolReader(self.scrape, self.clock, SERVING_METHODS[kind])
                self._readers[(label, zone)] = reader
            signals = reader.read({n: live.metrics_address_of(n) for n in rotation})
            stabilizer = self._stabilizers.setdefault((label, zone), Stabilizer())
            found_now = decide(
                zone, pool, signals, stabilizer, self.clock(), self.wall(), predicted
            )
            decision = replace(found_now, pool=label)
            self.metrics.observe(decision, len(rotation), len(standby))
            entry: dict[str, Any] = {
                "in_rotation": rotation,
                "standby": standby,
                "signals": signals.as_dict(),
                "floor": decision.floor,
                "decision": decision.line(),
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
