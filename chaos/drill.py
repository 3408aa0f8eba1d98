"""One running drill: its own mesh, the background load, the fault windows, the guard.

A drill is self-contained: the experiment's control (`servemesh.chaos.control`) starts a
mesh from a spec on free ports in the run's folder, starts open-loop load through its edge,
and stops both by PID at the end. Actions and probes find that mesh through `current()`.
Nothing here attaches to a mesh started by someone else, so a drill can never kill processes
or change routes it does not own.

Time zero of a drill is the first request of its load; fault windows, activity marks and
the guard's abort all use that clock, which is the clock of the report's timeline.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from servemesh.chaos.load import drill_load
from servemesh.chaos.mesh import DrillMesh, zone_namespace_mesh
from servemesh.credentials import authorization_value, read_edge_credentials
from servemesh.load import BackgroundLoad, WindowStats, window_stats
from servemesh.proxy.admin import AdminClient, AdminError
from servemesh.proxy.apply import RouteManager
from servemesh.spec import Instance, MeshSpec, load_spec

log = logging.getLogger(__name__)

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
    "tail_s": 3.0,  # load kept after the rollbacks, for the timeline
    "slo_success_pct": 99.5,  # what "held" means in the report's recovery numbers
    "guard_min_success_pct": 95.0,  # abort when success over guard_for_s falls below this
    "guard_for_s": 5.0,
    "guard_max_p99_ms": 0.0,  # 0: no latency guard
    # loopback: every zone on the machine's loopback (as `servemesh up`); netns: each zone's
    # services in a network namespace of their own (root), which partitions need.
    "network": "loopback",
}


class DrillError(RuntimeError):
    """A drill cannot do what was asked (no drill running, unknown replica...)."""


@dataclass
class FaultWindow:
    key: str
    label: str
    start_s: float
    end_s: float | None = None


@dataclass
class Mark:
    at_s: float
    label: str
    kind: str = "activity"  # activity, phase, guard


@dataclass
class GuardState:
    min_success_pct: float
    for_s: float
    max_p99_ms: float
    armed: bool = False
    tripped: bool = False
    reason: str = ""
    at_s: float | None = None


@dataclass
class Helpers:
    """Things a fault left running that the end of a drill must undo in any case."""

    hogs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    paused: dict[str, int] = field(default_factory=dict)  # name -> pid under SIGSTOP
    background: dict[str, tuple[threading.Thread, threading.Event]] = field(default_factory=dict)


_current: Drill | None = None
_lock = threading.Lock()


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
        self.load: BackgroundLoad | None = None
        self.admin: AdminClient | None = None
        self.routes: RouteManager | None = None
        self.windows: list[FaultWindow] = []
        self.marks: list[Mark] = []
        self.counters_start: dict[str, int] = {}
        self.counters_end: dict[str, int] = {}
        self.initial_weights: dict[str, dict[str, int]] = {}
        self.guard = GuardState(
            min_success_pct=float(config["guard_min_success_pct"]),
            for_s=float(config["guard_for_s"]),
            max_p99_ms=float(config["guard_max_p99_ms"] or 0),
        )
        self.abort = threading.Event()
        self.helpers = Helpers()
        self.phase = "starting"
        self.started_at = datetime.now().astimezone()
        self.summary: dict[str, Any] | None = None
        self.outcomes_final: list[Any] = []
        self.network: Any = None  # ZoneNetwork when the spec runs zones in namespaces
        self.experiment_title = name
        self.start_error = ""
        self.failed_activity = ""
        self._guard_thread: threading.Thread | None = None
        self._guard_stop = threading.Event()
        self._closed = False
        # Children of the drill itself (CPU hogs) are started from one long-lived thread,
        # so their parent-death signal fires only when the drill's process ends.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drill-spawner")

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the mesh and the load; return once the baseline has been observed."""
        global _current
        with _lock:
            if _current is not None and _current is not self:
                raise DrillError(f"another drill is running in this process: {_current.name}")
            _current = self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        spec = self._spec()
        self.mesh = DrillMesh.from_spec(spec, self.out_dir / "mesh")
        if self.config["network"] == "netns":
            self.mesh = zone_namespace_mesh(spec, self.out_dir / "mesh")
            self.network = self.mesh.network
        elif self.config["network"] != "loopback":
            raise DrillError(f"network {self.config['network']!r}: loopback or netns")
        self.mesh.start()
        self.admin = AdminClient(f"{self.mesh.spec.host}:{self.mesh.spec.ports.envoy_admin}")
        self.routes = RouteManager(self.mesh.paths, self.admin)
        self.initial_weights = {
            name: dict(model.traffic) for name, model in self.mesh.spec.models.items()
        }
        self.counters_start = self._counters()
        model = str(self.config["model"])
        if model not in self.mesh.spec.models:
            raise DrillError(f"model {model!r} is not in the spec {self.spec_path}")
        self.load = drill_load(
            self.mesh.spec.edge_address,
            rate_per_s=float(self.config["rate"]),
            model=model,
            entities=min(self.mesh.spec.demo.entities or 1, 1000),
            timeout_s=float(self.config["load_timeout_s"]),
            metadata=self._edge_metadata(),
        )
        self.load.start()
        self.mark("load started", "phase")
        self._guard_thread = threading.Thread(target=self._guard_loop, name="drill-guard")
        self._guard_thread.daemon = True
        self._guard_thread.start()
        self.phase = "baseline"
        self.sleep(float(self.config["baseline_s"]))

    def _edge_metadata(self) -> list[tuple[str, str]]:
        """The edge's credentials when the spec turns edge auth on (the launcher made them)."""
        credentials = read_edge_credentials(self.running_mesh.state_dir)
        return [("authorization", authorization_value(*credentials))] if credentials else []

    def _spec(self) -> MeshSpec:
        return load_spec(self.spec_path)

    def finish(self) -> None:
        """Keep the load for the tail, then stop it and read the final numbers."""
        if self.load is None:
            return
        self.phase = "tail"
        # Not cut short by the guard: after an abort the tail shows the recovery.
        time.sleep(float(self.config["tail_s"]))
        self.mark("load stopped", "phase")
        end_s = self.now_s()
        self.load.stop()
        self.counters_end = self._counters()
        for window in self.windows:
            if window.end_s is None:
                window.end_s = end_s
                window.label += " (still open at the end)"
        self.outcomes_final = self.load.snapshot()

    def close(self) -> None:
        """Undo what faults left running, stop the load and the mesh. Idempotent."""
        global _current
        if self._closed:
            return
        self._closed = True
        self._guard_stop.set()
        try:
            self.stop_background()
            self.resume_all()
            self.stop_hogs()
            if self.network is not None:
                self.network.heal()
        finally:
            try:
                if self.load is not None and self.load.running:
                    self.load.stop()
            finally:
                try:
                    if self.mesh is not None:
                        self.mesh.stop()
                finally:
                    # After the processes inside the namespaces have stopped.
                    if self.network is not None:
                        self.network.close()
                    self._spawner.shutdown()
                    with _lock:
                        if _current is self:
                            _current = None

    # --- clock, marks, windows -------------------------------------------------------------

    def now_s(self) -> float:
        return self.load.now_s() if self.load is not None else 0.0

    def mark(self, label: str, kind: str = "activity") -> None:
        self.marks.append(Mark(round(self.now_s(), 3), label, kind))

    def open_window(self, key: str, label: str) -> None:
        if any(w.key == key and w.end_s is None for w in self.windows):
            return
        self.windows.append(FaultWindow(key, label, round(self.now_s(), 3)))

    def close_window(self, key: str) -> None:
        for window in self.windows:
            if window.key == key and window.end_s is None:
                window.end_s = round(self.now_s(), 3)

    def close_windows(self, prefix: str) -> None:
        for window in self.windows:
            if window.key.startswith(prefix) and window.end_s is None:
                window.end_s = round(self.now_s(), 3)

    def fault_stats(self) -> WindowStats | None:
        """Calls sent while any fault window was open; None before the first window."""
        if not self.windows or self.load is None:
            return None
        now = self.now_s()
        spans = [(w.start_s, w.end_s if w.end_s is not None else now) for w in self.windows]
        outcomes = [o for o in list(self.load.outcomes) if any(a <= o.sent_s < b for a, b in spans)]
        return window_stats(outcomes, 0.0, float("inf"))

    def sleep(self, seconds: float) -> bool:
        """Wait while the load runs; returns False at once when the guard trips."""
        if seconds <= 0:
            return not self.abort.is_set()
        return not self.abort.wait(seconds)

    # --- the guard -------------------------------------------------------------------------

    def arm_guard(self) -> None:
        self.guard.armed = True

    def disarm_guard(self) -> None:
        self.guard.armed = False

    def _guard_loop(self) -> None:
        while not self._guard_stop.wait(0.25):
            if not self.guard.armed or self.abort.is_set() or self.load is None:
                continue
            stats = self.load.last(self.guard.for_s)
            # Judge a full window only: enough calls answered to mean something.
            if stats.sent < max(10, 0.5 * self.load.rate_per_s * self.guard.for_s):
                continue
            reason = ""
            if stats.success_pct < self.guard.min_success_pct:
                reason = (
                    f"success {stats.success_pct:.1f}% < {self.guard.min_success_pct:g}% "
                    f"over the last {self.guard.for_s:g} s"
                )
            elif self.guard.max_p99_ms and stats.p99_ms > self.guard.max_p99_ms:
                reason = (
                    f"p99 {stats.p99_ms:.0f} ms > {self.guard.max_p99_ms:g} ms "
                    f"over the last {self.guard.for_s:g} s"
                )
            if reason:
                self.trip(reason)

    def trip(self, reason: str) -> None:
        if self.abort.is_set():
            return
        self.guard.tripped = True
        self.guard.reason = reason
        self.guard.at_s = round(self.now_s(), 3)
        self.mark(f"guard: {reason}", "guard")
        log.warning("drill guard tripped: %s", reason)
        self.abort.set()

    # --- the mesh --------------------------------------------------------------------------

    @property
    def spec(self) -> MeshSpec:
        return self.running_mesh.spec

    @property
    def running_mesh(self) -> DrillMesh:
        if self.mesh is None:
            raise DrillError("the drill's mesh is not running")
        return self.mesh

    def select(
        self,
        service: str = "model",
        zone: str | None = None,
        replicas: list[str] | str | None = None,
    ) -> list[Instance]:
        """Instances of `service` in `zone` (all zones when None), or the named replicas."""
        if isinstance(replicas, str):
            replicas = [replicas]
        instances = self.spec.instances()
        if replicas:
            known = {i.name for i in instances}
            unknown = sorted(set(replicas) - known)
            if unknown:
                raise DrillError(f"no replicas named {unknown}; known: {sorted(known)}")
            return [i for i in instances if i.name in replicas]
        if zone is not None and zone not in self.spec.zones:
            raise DrillError(f"no zone {zone!r}; zones: {self.spec.zones}")
        chosen = [i for i in instances if i.service == service and (zone is None or i.zone == zone)]
        if not chosen:
            raise DrillError(f"no {service} replicas in {zone or 'any zone'}")
        return chosen

    def _counters(self) -> dict[str, int]:
        if self.admin is None:
            return {}
        try:
            return self.admin.counters("cluster.")
        except AdminError:
            return {}

    # --- helpers that outlive one activity ---------------------------------------------------

    def pause(self, name: str) -> int:
        child = self.running_mesh.children[name]
        if not child.alive():
            raise DrillError(f"{name} is not running")
        os.kill(child.pid, signal.SIGSTOP)
        self.helpers.paused[name] = child.pid
        return child.pid

    def resume(self, name: str) -> bool:
        pid = self.helpers.paused.pop(name, None)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return False
        return True

    def resume_all(self) -> None:
        for name in list(self.helpers.paused):
            self.resume(name)

    def start_background(self, key: str, target: Callable[[threading.Event], None]) -> None:
        """Run target(stop_event) in a thread until stop_background(key)."""
        if key in self.helpers.background:
            return
        stop = threading.Event()
        thread = threading.Thread(target=target, args=(stop,), name=f"drill-{key}", daemon=True)
        self.helpers.background[key] = (thread, stop)
        thread.start()

    def stop_background(self, key: str | None = None) -> list[str]:
        keys = [key] if key is not None else list(self.helpers.background)
        stopped = []
        for name in keys:
            entry = self.helpers.background.pop(name, None)
            if entry is None:
                continue
            thread, stop = entry
            stop.set()
            thread.join(30)
            stopped.append(name)
        return stopped

    def spawn_hog(self) -> int:
        """A process that burns one CPU until stopped (by PID) or this process dies."""
        argv = [sys.executable, "-c", "while True: pass"]
        setpriv = shutil.which("setpriv")
        if setpriv:
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        proc = self._spawner.submit(
            subprocess.Popen,
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        ).result()
        self.helpers.hogs.append(proc)
        return proc.pid

    def stop_hogs(self) -> list[int]:
        stopped = []
        for proc in self.helpers.hogs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            stopped.append(proc.pid)
        self.helpers.hogs.clear()
        return stopped

    # --- what the live view shows ------------------------------------------------------------

    def status_line(self) -> dict[str, Any]:
        if self.load is None:
            return {"phase": self.phase}
        stats = self.load.last(5.0)
        open_faults = [w.label for w in self.windows if w.end_s is None]
        return {
            "t": self.now_s(),
            "phase": self.phase,
            "stats": stats,
            "faults": open_faults,
            "guard": self.guard,
        }


def wait_until(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
