"""One running drill: its own mesh and background load, from start to close.

A drill is self-contained: the experiment's control (`servemesh.chaos.control`) starts a
mesh from a spec on free ports in the run's folder, starts open-loop load through its edge,
and stops both by PID at the end. Actions and probes find that mesh through `current()`.
Nothing here attaches to a mesh started by someone else, so a drill can never kill processes
or change routes it does not own.

The drill's other parts live beside it: its timeline of fault windows and marks
(`chaos.timeline`), its guard (`chaos.guard`), what faults leave running
(`chaos.leftovers`) and which instances a fault acts on (`chaos.scope`).
"""

from __future__ import annotations

import re
import signal
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from servemesh.chaos.containers import ComposeMesh
from servemesh.chaos.errors import DrillError
from servemesh.chaos.guard import Guard
from servemesh.chaos.leftovers import Leftovers
from servemesh.chaos.load import drill_load
from servemesh.chaos.mesh import DrillMesh
from servemesh.chaos.scope import select
from servemesh.chaos.timeline import FaultWindow, Mark, Timeline
from servemesh.identity import Dial, dial_edge_at, dial_every_edge
from servemesh.load import BackgroundLoad, WindowStats, window_stats
from servemesh.procs.netns import ZoneNetwork
from servemesh.proxy.admin import AdminClient, AdminError
from servemesh.proxy.apply import RouteManager
from servemesh.spec import Instance, MeshSpec, ResolvedSpec, load_spec
from servemesh.state.credentials import authorization_value, read_edge_credentials

__all__ = [
    "DEFAULTS",
    "EXPERIMENTS_DIR",
    "Drill",
    "DrillError",
    "FaultWindow",
    "Mark",
    "current",
    "resolve_spec",
    "slug",
]

PACKAGE_DIR = Path(__file__).resolve().parent
SPECS_DIR = PACKAGE_DIR / "specs"
EXPERIMENTS_DIR = PACKAGE_DIR / "experiments"

# Configuration keys a drill reads, and their defaults (experiments override them in their
# `configuration` block, `servemesh chaos run --var key=value` on the command line).
DEFAULTS: dict[str, Any] = {
    "spec": "drill-mesh",  # a spec file, or the name of one in chaos/specs/
    "out_dir": "",  # default: chaos-runs/<experiment file>-<time>
    "model": "fraud",
    "rate": 100.0,  # Predict calls per second, open loop
    "load_timeout_s": 2.0,  # each call's deadline
    "baseline_s": 10.0,  # load before the steady state is first checked
    # Then, at most this long, until the last `slo_window_s` looks settled (every call
    # answered for real, every zone serving); 0: check right after the baseline.
    "settle_s": 20.0,
    "tail_s": 3.0,  # load kept after the rollbacks, for the timeline
    # End the recovery watch once recovered (recover_s is then its longest) rather than
    # watching all of recover_s: for the suite's shortened drills on a busy machine.
    "recover_early": False,
    "slo_success_pct": 99.5,  # what "held" means in the report's recovery numbers
    "guard_min_success_pct": 95.0,  # abort when success over guard_for_s falls below this
    "guard_for_s": 5.0,
    "guard_max_p99_ms": 0.0,  # 0: no latency guard
    # The spec's `network.mode` unless set: loopback (every zone on the machine's loopback,
    # as `servemesh up`) or netns (each zone's services in a network namespace of their
    # own, root only), which partitions need.
    "network": "",
    # The spec's `proxy.layout` unless set: shared (one Envoy) or per_zone (the edge and
    # each zone an Envoy of their own), which the zone-proxy-crash drill needs.
    "proxy": "",
    # processes (a mesh of processes the drill starts, as `servemesh up`) or compose (a
    # compose project of `compose_file` the drill starts on the local images, as `make
    # compose-up`: the container drills, chaos/container_actions.py). Paths are relative
    # to the folder the drill runs from (a checkout).
    "mesh": "processes",
    "compose_file": "deploy/compose/dns.yml",
    "compose_spec": "deploy/compose/mesh-dns.yaml",
    "image_tag": "dev",
}

# How often the settle step after the baseline looks at the load's last window.
SETTLE_POLL_S = 0.5

_current: Drill | None = None
_lock = threading.Lock()

Handoff = TypeVar("Handoff")


def current() -> Drill:
    """The drill running in this process; actions and probes act on its mesh only."""
    if _current is None:
        raise DrillError(
            "no drill is running: the experiment must declare the control "
            "servemesh.chaos.control (it starts the mesh and the load)"
        )
    return _current


def resolve_spec(value: str) -> Path:
    """A spec file as given, else chaos/specs/<value>(.yaml)."""
    path = Path(value)
    if path.is_file():
        return path.resolve()
    for candidate in (SPECS_DIR / value, SPECS_DIR / f"{value}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in SPECS_DIR.glob("*.yaml"))
    raise DrillError(f"no mesh spec {value!r} (a file, or one of chaos/specs/: {known})")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "drill"


class Drill:
    def __init__(self, name: str, configuration: dict[str, Any] | None = None) -> None:
        config = {**DEFAULTS, **{k: v for k, v in (configuration or {}).items() if v is not None}}
        self.name = name
        self.config = config
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.out_dir = Path(config["out_dir"] or Path("chaos-runs") / f"{slug(name)}-{stamp}")
        self.out_dir = self.out_dir.resolve()
        self.spec_path = resolve_spec(str(config["spec"]))
        self.mesh: DrillMesh | None = None
        self.compose: ComposeMesh | None = None
        self.load: BackgroundLoad | None = None
        self.admin: AdminClient | None = None
        self.routes: RouteManager | None = None
        self.timeline = Timeline(self.now_s)
        self.guard = Guard(
            min_success_pct=float(config["guard_min_success_pct"]),
            for_s=float(config["guard_for_s"]),
            max_p99_ms=float(config["guard_max_p99_ms"] or 0),
            on_trip=lambda reason: self.timeline.mark(f"guard: {reason}", "guard"),
        )
        self.leftovers = Leftovers()
        self.counters_start: dict[str, int] = {}
        self.counters_end: dict[str, int] = {}
        self.initial_weights: dict[str, dict[str, int]] = {}
        self.phase = "starting"
        self.started_at = datetime.now().astimezone()
        self.summary: dict[str, Any] | None = None
        self.outcomes_final: list[Any] = []
        self.experiment_title = name
        self.start_error = ""
        self.failed_activity = ""
        self._closed = False
        # What one drill's steps hand one another (a backup taken, a process killed), by
        # the kind of record a drill module keeps: see handoff().
        self._handoffs: dict[type, Any] = {}

    def handoff(self, kind: type[Handoff]) -> Handoff:
        """This drill's record of `kind` (a dataclass a drill module declares), made empty
        at its first use: one step writes what a later one reads."""
        found: Handoff = self._handoffs.setdefault(kind, kind())
        return found

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the mesh and the load; return once the baseline has been observed."""
        global _current
        with _lock:
            if _current is not None and _current is not self:
                raise DrillError(f"another drill is running in this process: {_current.name}")
            _current = self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.config["mesh"] == "compose":
            edge = self._start_compose()
        elif self.config["mesh"] == "processes":
            self.mesh = DrillMesh.from_spec(self._mesh_spec(), self.out_dir / "mesh")
            self.mesh.start()
            self.admin = AdminClient.of_mesh(self.mesh.state_dir)
            self.routes = RouteManager(self.mesh.paths, self.admin)
            # Every zone's edge, as callers are told to connect (docs/architecture.md).
            edge = dial_every_edge(self.mesh.spec)
        else:
            raise DrillError(f"mesh {self.config['mesh']!r}: processes or compose")
        self.initial_weights = {
            name: dict(model.traffic) for name, model in self.spec.models.items()
        }
        self.counters_start = self.counters()
        model = str(self.config["model"])
        if model not in self.spec.models:
            raise DrillError(f"model {model!r} is not in the drill's mesh spec")
        self.load = drill_load(
            edge,
            rate_per_s=float(self.config["rate"]),
            model=model,
            entities=min(self.spec.demo.entities or 1, 1000),
            timeout_s=float(self.config["load_timeout_s"]),
            metadata=self._edge_metadata(),
        )
        self.load.start()
        self.timeline.mark("load started", "phase")
        self.guard.watch(self.load, self.now_s)
        self.phase = "baseline"
        self.sleep(float(self.config["baseline_s"]))
        self._settle()

    def _settle(self) -> None:
        """Wait, at most `settle_s`, until the load's last window looks settled: every call
        answered (none by a fallback) and every zone serving at least half its equal share.

        A fresh mesh on a busy machine can have a replica ejected by Envoy, or a zone slow,
        for its first seconds; judging the steady state then would call the drill NOT-RUN
        for its start-up rather than for the mesh. A mesh that does not settle is judged as
        it is (the steady state then says what was wrong). The wait is on the timeline."""
        limit = float(self.config["settle_s"])
        window = float(self.config.get("slo_window_s", 5.0))
        zones = self.spec.zones
        began = self.now_s()
        looked = 0
        while not self._settled(window, zones):
            if self.now_s() - began >= limit or not self.sleep(SETTLE_POLL_S):
                self.timeline.mark(f"not settled after {self.now_s() - began:.1f} s")
                return
            looked += 1
        if looked:
            self.timeline.mark(f"settled after {self.now_s() - began:.1f} s more")

    def _settled(self, window_s: float, zones: list[str]) -> bool:
        assert self.load is not None
        stats = self.load.last(window_s)
        floor = 100.0 / len(zones) / 2 if zones else 0.0
        return (
            stats.sent > 0
            and stats.failed == 0
            and stats.degraded == 0
            and all(stats.zones.get(zone, 0.0) >= floor for zone in zones)
        )

    def _start_compose(self) -> Dial:
        """Start the drill's own compose project; how to reach its edge on this host."""
        self.compose = ComposeMesh(
            compose_file=Path(str(self.config["compose_file"])).resolve(),
            compose_spec=Path(str(self.config["compose_spec"])).resolve(),
            project=f"servemesh-drill-{slug(self.name)[:30].rstrip('-')}",
            image_tag=str(self.config["image_tag"]),
        )
        self.compose.start()
        self.routes = RouteManager(self.compose.paths)
        self.admin = self.routes.admin
        return dial_edge_at(self.compose.spec, self.compose.edge_address)

    def _mesh_spec(self) -> MeshSpec:
        """The spec file, with the network and the Envoy layout the configuration asks
        for (each only if set)."""
        spec = load_spec(self.spec_path)
        for key, section, field_name, allowed in (
            ("network", "network", "mode", ("loopback", "netns")),
            ("proxy", "proxy", "layout", ("shared", "per_zone")),
        ):
            value = self.config[key]
            if value == "":
                continue
            if value not in allowed:
                raise DrillError(f"{key} {value!r}: {' or '.join(allowed)}")
            part = getattr(spec, section).model_copy(update={field_name: value})
            spec = spec.model_copy(update={section: part})
        return spec

    def _edge_metadata(self) -> list[tuple[str, str]]:
        """The edge's credentials when the spec turns edge auth on (the launcher made them)."""
        state_dir = self.compose.state_dir if self.compose else self.running_mesh.state_dir
        credentials = read_edge_credentials(state_dir)
        return [("authorization", authorization_value(*credentials))] if credentials else []

    def finish(self) -> None:
        """Keep the load for the tail, then stop it and read the final numbers."""
        if self.load is None:
            return
        self.phase = "tail"
        # Not cut short by the guard: after an abort the tail shows the recovery.
        time.sleep(float(self.config["tail_s"]))
        self.timeline.mark("load stopped", "phase")
        end_s = self.now_s()
        self.load.stop()
        self.counters_end = self.counters()
        self.timeline.close_all(end_s)
        self.outcomes_final = self.load.snapshot()

    def close(self) -> None:
        """Undo what faults left running, stop the load and the mesh. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # A second SIGTERM (Chaos Toolkit turns each into an interruption) must not cut the
        # cleanup short and leave the zones' namespaces and rules behind.
        ignoring = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if ignoring else None
        try:
            self._close()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _close(self) -> None:
        global _current
        self.guard.close()
        try:
            self.leftovers.close()
            if self.network is not None:
                self.network.heal()
        finally:
            try:
                if self.load is not None and self.load.running:
                    self.load.stop()
            finally:
                try:
                    # The mesh removes the zones' namespaces after the processes in them.
                    if self.mesh is not None:
                        self.mesh.stop()
                    if self.compose is not None:
                        self.compose.stop()
                finally:
                    with _lock:
                        if _current is self:
                            _current = None

    # --- time ----------------------------------------------------------------------------

    def now_s(self) -> float:
        """Seconds since the load's first request: the clock of the drill's timeline."""
        return self.load.now_s() if self.load is not None else 0.0

    def sleep(self, seconds: float) -> bool:
        """Wait while the load runs; returns False at once when the guard trips."""
        if seconds <= 0:
            return not self.abort.is_set()
        return not self.abort.wait(seconds)

    @property
    def abort(self) -> threading.Event:
        return self.guard.abort

    # The timeline's windows and marks, as the report reads (and its tests set) them.
    @property
    def windows(self) -> list[FaultWindow]:
        return self.timeline.windows

    @windows.setter
    def windows(self, windows: list[FaultWindow]) -> None:
        self.timeline.windows = windows

    @property
    def marks(self) -> list[Mark]:
        return self.timeline.marks

    @marks.setter
    def marks(self, marks: list[Mark]) -> None:
        self.timeline.marks = marks

    def fault_stats(self) -> WindowStats | None:
        """Calls sent while any fault window was open; None before the first window."""
        if not self.windows or self.load is None:
            return None
        spans = self.timeline.spans(self.now_s())
        outcomes = [o for o in list(self.load.outcomes) if any(a <= o.sent_s < b for a, b in spans)]
        return window_stats(outcomes, 0.0, float("inf"))

    # --- the mesh --------------------------------------------------------------------------

    @property
    def spec(self) -> ResolvedSpec:
        return self.compose.spec if self.compose is not None else self.running_mesh.spec

    @property
    def running_mesh(self) -> DrillMesh:
        if self.compose is not None:
            raise DrillError(
                "this drill runs on containers (`mesh: compose`): its faults are the "
                "container actions (servemesh.chaos.container_actions)"
            )
        if self.mesh is None:
            raise DrillError("the drill's mesh is not running")
        return self.mesh

    @property
    def network(self) -> ZoneNetwork | None:
        """The zones' namespaces when the mesh runs them (`network: netns`), else None."""
        return self.mesh.network if self.mesh is not None else None

    def admin_of_zone(self, zone: str) -> AdminClient:
        """The admin API of the Envoy holding `zone`'s mesh listener and clusters: the
        mesh's only one in the shared layout, the zone's own in the per-zone layout."""
        routes = self._routes()
        return routes.admin_of(self.spec.proxy_of_zone(zone))

    def admin_of_proxy(self, proxy: str) -> AdminClient:
        """The admin API of one of the mesh's Envoys by name (spec.proxies())."""
        return self._routes().admin_of(proxy)

    def route_admins(self, route: str) -> list[AdminClient]:
        """The Envoys that serve `route` (a fault filter's name, wire.fault_runtime_prefix):
        `edge` is every edge Envoy's (one per zone with proxy.edges per_zone); a model's or
        the feature route is every zone's mesh listener,
        each Envoy named once (one in the shared layout)."""
        routes = self._routes()
        if route == "edge":
            return [routes.admin_of(proxy) for proxy in self.spec.edge_proxies()]
        proxies = dict.fromkeys(self.spec.proxy_of_zone(zone) for zone in self.spec.zones)
        return [routes.admin_of(proxy) for proxy in proxies]

    def _routes(self) -> RouteManager:
        if self.routes is None:
            raise DrillError("the drill's mesh is not running")
        return self.routes

    def select(
        self,
        service: str = "model",
        zone: str | None = None,
        replicas: list[str] | str | None = None,
    ) -> list[Instance]:
        """Instances of `service` in `zone` (all zones when None), or the named replicas."""
        return select(self.spec, service, zone, replicas)

    def kill(self, name: str, *, revive: bool = False) -> int | None:
        """SIGKILL a running instance (paused or not); its PID, None when it was down.

        The outage is the drill's: the instance stays down until the drill restarts it
        (Mesh.kill), though the mesh starts crashed processes again by itself. `revive`:
        the drill tests that recovery instead, and the mesh starts it again (a crash)."""
        mesh = self.running_mesh
        if not mesh.is_running(name):
            return None
        self.leftovers.forget_pause(name)
        return mesh.kill(name, signal.SIGKILL, revive=revive)

    def pause(self, name: str) -> int | None:
        """SIGSTOP a running instance until resume() or the end of the drill; its PID,
        None when it is down or paused already."""
        mesh = self.running_mesh
        if not mesh.is_running(name) or self.leftovers.is_paused(name):
            return None
        pid = mesh.send_signal(name, signal.SIGSTOP)
        self.leftovers.paused_with(name, pid)
        return pid

    def resume(self, name: str) -> bool:
        return self.leftovers.resume(name)

    def counters(self) -> dict[str, int]:
        """Every Envoy's cluster counters, summed (one Envoy, or the edge's and each
        zone's); {} when none answers."""
        if self.admin is None or self.routes is None or (self.mesh is None and not self.compose):
            return {}
        found: dict[str, int] = {}
        for admin in self.routes.admins(self.spec).values():
            try:
                counters = admin.counters("cluster.")
            except AdminError:
                continue
            for name, value in counters.items():
                found[name] = found.get(name, 0) + value
        return found

    # --- what the live view shows ------------------------------------------------------------

    def status_line(self) -> dict[str, Any]:
        if self.load is None:
            return {"phase": self.phase}
        return {
            "t": self.now_s(),
            "phase": self.phase,
            "stats": self.load.last(5.0),
            "faults": self.timeline.open_labels(),
            "guard": self.guard,
        }
