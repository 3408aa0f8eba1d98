"""Start and stop a whole local mesh from a spec: Redis, registry, services, Envoy.

Every process is a child of the mesh's supervisor (`servemesh.procs`), stopped by PID in
reverse start order: SIGTERM first (services drain), SIGKILL only after the grace period.
With `network: {mode: netns}` in the spec, each zone's gateway, feature and model
processes run in a network namespace of the zone's own (`servemesh.procs.netns`); Envoy, the
registry and Redis stay on the machine, and every address stays on loopback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import grpc

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.control_credential import (
    CONTROL_VERIFIER_ENV,
    ensure_control_token,
    token_digest,
)
from servemesh.contract.inflight import discard, journal_path, read_inflight
from servemesh.contract.wire import ENVOY_STATS_PATH, message_size_options
from servemesh.contract.yaml_text import dump_yaml
from servemesh.identity import (
    OPERATOR_IDENTITY,
    TRACE_STORE_IDENTITY,
    dial_address,
    dial_edge_at,
    dial_registry,
    dial_service,
    issue_mesh_certificates,
    mesh_identity,
)
from servemesh.identity.tokens import ensure_signing_key
from servemesh.procs import (
    All,
    Check,
    Child,
    GrpcHealth,
    ProcessError,
    Readiness,
    RedisServer,
    StartError,
    Supervisor,
)
from servemesh.procs.alertmanager import NAME as ALERTMANAGER_NAME
from servemesh.procs.alertmanager import RECEIVER_NAME, Alerting, alertmanager_binary
from servemesh.procs.liveness import LivenessPolicy, LivenessWatch, Target
from servemesh.procs.netns import ZoneNetwork
from servemesh.procs.netns import available as netns_available
from servemesh.procs.prometheus import PrometheusServer, prometheus_binary
from servemesh.procs.restarts import (
    ENVOY_RESTARTS,
    SERVICE_RESTARTS,
    RestartPolicy,
    RestartRecord,
    Restarts,
)
from servemesh.procs.sandbox import RunAs, model_user, pool_users
from servemesh.procs.sentinel import SentinelServer, quorum_of
from servemesh.proxy.admin import admin_socket_path, prepare_admin_dir
from servemesh.proxy.apply import RouteManager, write_initial
from servemesh.proxy.process import envoy_command, is_ready, validate_config
from servemesh.proxy.render import dynamic_bootstrap, render_proxies, static_bootstrap
from servemesh.quarantine import Quarantine, move_traffic_away
from servemesh.seeding import SeedConflict, SeedStep, seed_demo
from servemesh.spec import (
    FLEET_STATUS_FILE,
    MeshSpec,
    ResolvedSpec,
    SpecError,
    dump_spec,
    is_edge_proxy,
    load_resolved,
    proxy_part,
    registry_mirror_name,
    resolve,
)
from servemesh.state.credentials import ensure_edge_credentials, htpasswd_line
from servemesh.state.lock import Holder, MeshLock, refuse_if_held
from servemesh.state.paths import MeshPaths
from servemesh.state.sharing import (
    own_written,
    secure_state_dir,
    share_identity,
    share_with_models,
    tighten,
)

log = logging.getLogger(__name__)

SERVICE_MODULES = {
    "registry": "servemesh.registry",
    "model": "servemesh.services.model",
    "feature": "servemesh.services.feature",
    "gateway": "servemesh.services.gateway",
}
# The mesh's own Python services, forked from one interpreter that imported these modules
# beforehand (spec `processes.fork_server`; servemesh.procs.forkserver): python -m module ->
# what its entry imports. Model servers are not here: they run as their pool's user (below).
FORKED_MODULES: dict[str, tuple[str, ...]] = {
    "servemesh.registry": ("servemesh.registry.app", "servemesh.services.runtime.entry"),
    "servemesh.services.gateway": (
        "servemesh.services.gateway.app",
        "servemesh.services.runtime.entry",
    ),
    "servemesh.services.feature": (
        "servemesh.services.feature.app",
        "servemesh.services.runtime.entry",
    ),
    "servemesh.tracestore": ("servemesh.tracestore.receiver",),
    "servemesh.scaling": (
        "servemesh.scaling.loop",
        "servemesh.scaling.metrics",
        "servemesh.proxy.admin",
        "servemesh.proxy.apply",
        "prometheus_client",
    ),
}
# Model servers run as their pool's user: when they do, each pool's user gets a fork server
# of its own, running as that user, that imports torch and the model server once for the
# pool's replicas (spec `processes.fork_server`; servemesh.procs.spawn `forked_as`).
FORKED_AS_POOL_USER: dict[str, tuple[str, ...]] = {
    "servemesh.services.model": (
        "servemesh.services.model.app",
        "servemesh.services.runtime.entry",
    ),
}
# Stop order, a tier of groups at a time: the reverse of the start order, so Envoy stops
# taking calls first and Redis goes last. Once the gateways are gone nothing calls a feature,
# model or registry server, so those drain together (each takes half a second or more to
# exit; one after another they added a second to every stop).
# The trace store stops after every service, so the spans they flush on the way out land.
# Stream consumers (servemesh.streams) stop first: each finishes its batch in flight; with
# them the batch scheduler (a run in flight is left interrupted, its output never half there).
# The scaler stops with them, first: it changes the fleet the mesh stops.
STOP_ORDER = [
    ["stream", "batch", "scaler"],
    ["prometheus", "alertmanager"],
    ["envoy"],
    ["gateway"],
    ["feature", "model", "registry"],
    ["tracestore"],
    ["redis"],
]
TRACE_STORE = "tracestore"
# How often the mesh looks at its resolved spec for a change of its fleet of replicas
# (a blue-green set to start or retire, a replica a rolling update replaces).
FLEET_POLL_S = 0.2
# The kinds of process the mesh starts again when one exits unexpectedly (a crash, an OOM
# kill), after crash-loop backoff (servemesh.procs.restarts); with them the Envoys of the
# per-zone layout. The store's servers ("redis": the primary, the replicas, the Sentinels)
# come back with their append-only files, and Sentinel makes an old primary a replica of
# the one it promoted meanwhile. Prometheus, stream consumers, the batch scheduler and the
# scaler are not: their exits are reported (`servemesh up`), the operator decides.
# The supervisor's group of the zones' registry mirrors (registry/mirror.py).
REGISTRY_MIRROR_GROUP = "registry-mirror"
REVIVED_KINDS = frozenset(
    {"model", "gateway", "feature", "registry", REGISTRY_MIRROR_GROUP, TRACE_STORE, "redis"}
)
# How long a process started again may take to report ready before the mesh says so in its
# log (it is left running: a slow start is not a crash).
REVIVE_READY_TIMEOUT_S = 60.0
# The Redis setting the feature services' change feed needs (K: keyspace events, $: writes
# to strings).
KEYSPACE_EVENTS = "notify-keyspace-events K$"


def envoy_child(proxy: str) -> str:
    """The supervisor's name for one of the mesh's Envoys: its name as a part of the mesh
    (`envoy` for the edge's, the shared layout's only one; `envoy-<zone>` for a zone's)."""
    return proxy_part(proxy)


class MeshStartError(StartError):
    """The mesh cannot start here (e.g. zones in namespaces without root)."""


@dataclass
class Mesh:
    """A running local mesh. Use as a context manager, or call start() and stop().

    Made with `from_spec`, which resolves the declared spec at once: every port is known
    before anything starts, so endpoints and addresses never wait for `start()`.
    """

    spec: ResolvedSpec
    state_dir: Path
    grace_s: float = 10.0
    # Run in order after the demo seeding (servemesh.seeding), when the spec's demo is on.
    seed_steps: list[SeedStep] = field(default_factory=list)
    supervisor: Supervisor = field(init=False, repr=False)
    # The Redis this mesh started (None when the spec names one of its own).
    redis: RedisServer | None = field(default=None, init=False)
    # A replicated store's (feature_store.topology): each zone's replica, and its Sentinels
    # by zone (and "witness", the one in no zone).
    store_replicas: dict[str, RedisServer] = field(default_factory=dict, init=False)
    sentinels: dict[str, SentinelServer] = field(default_factory=dict, init=False)
    # The zones' namespaces, with `network: {mode: netns}` (None on one loopback).
    network: ZoneNetwork | None = field(default=None, init=False)
    # The mesh's Prometheus (None: metrics.prometheus is off, or no binary is installed).
    prometheus: PrometheusServer | None = field(default=None, init=False)
    # Its Alertmanager and the mesh's alert receiver (None: none runs).
    alerting: Alerting | None = field(default=None, init=False)
    # The fleet follower: the generation each replica was started at, by instance.
    _fleet: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _fleet_stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _fleet_thread: threading.Thread | None = field(default=None, init=False, repr=False)
    # Crash-loop backoff and restart counts of every process the mesh starts again itself.
    _restarts: Restarts = field(init=False, repr=False)
    # The exited process each scheduled restart replaces (its exit is counted once), and
    # the processes started again that have not reported ready yet (with a deadline).
    _crashed: dict[str, Child] = field(default_factory=dict, init=False, repr=False)
    _reviving: dict[str, tuple[Child, float]] = field(default_factory=dict, init=False, repr=False)
    # The fleet thread's revivals and a drill's restart() never start one name twice.
    _restart_lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)
    # The user model servers run as (servemesh.procs.sandbox); None: the launcher's own.
    model_user: RunAs | None = field(default=None, init=False)
    # Run the scaler (servemesh.scaling) beside the mesh when the spec's scaling is on:
    # `servemesh up` does; a test's mesh keeps its size unless it asks for one.
    scaler: bool = False
    # Quarantines run here, one at a time, off the fleet's thread: a route change waits
    # for every Envoy to confirm it, and no restart of another process should wait on it.
    _quarantines: concurrent.futures.ThreadPoolExecutor | None = field(
        default=None, init=False, repr=False
    )
    # The state dir's lock, held from start() to stop() (servemesh/state/lock.py), and the
    # killed mesh whose lock this one took over, if any.
    _lock: MeshLock | None = field(default=None, init=False, repr=False)
    took_over: Holder | None = field(default=None, init=False)
    # Probes every model server's liveness and kills the ones hung for good, which the
    # fleet's thread then starts again (servemesh.procs.liveness); None: not running.
    liveness: LivenessWatch | None = field(default=None, init=False)
    # Why a process was killed for liveness (until its exit is counted), and the cause of
    # each process's last unexpected exit when the mesh itself caused it (fleet status).
    _liveness_kills: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _exit_causes: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(
            self.logs_dir,
            cwd=self.state_dir,
            grace_s=self.grace_s,
            thread_name="mesh-spawner",
            forked=FORKED_MODULES if self.spec.processes.fork_server else None,
            forked_as=FORKED_AS_POOL_USER if self.spec.processes.fork_server else None,
        )
        self._restarts = Restarts(self._restart_policy)

    @classmethod
    def from_spec(
        cls, spec: MeshSpec, state_dir: Path | None = None, *, seed_steps: Sequence[SeedStep] = ()
    ) -> Self:
        root = Path(state_dir or spec.state_dir).resolve()
        # Before anything below touches the state dir: one a live mesh holds is its own (a
        # chmod or a rewritten credential here would break it).
        refuse_if_held(root)
        # Umask 077 from here on; the state dir 0700 and its secrets private, or no start.
        secure_state_dir(root)
        spec = with_edge_credentials(spec.model_copy(update={"state_dir": str(root)}), root)
        # Control calls (loads, uploads, feature writes) need this mesh's token.
        ensure_control_token(root)
        resolved = resolve(spec)
        mesh = cls(spec=resolved, state_dir=root)
        mesh.seed_steps.extend(seed_steps)
        return mesh

    # --- paths -------------------------------------------------------------------

    @property
    def paths(self) -> MeshPaths:
        return MeshPaths(self.state_dir)

    @property
    def logs_dir(self) -> Path:
        return self.paths.logs

    @property
    def resolved_spec_path(self) -> Path:
        return self.paths.resolved_spec

    @property
    def envoy_config_path(self) -> Path:
        return self.paths.envoy_config

    @property
    def endpoints_path(self) -> Path:
        return self.paths.endpoints

    # --- lifecycle ---------------------------------------------------------------

    def hold_state_dir(self) -> Holder | None:
        """Take the state dir's lock for this mesh's life (StateDirHeld when a live mesh
        holds it); the killed mesh it took the lock over from, if any. start() takes it."""
        if self._lock is None:
            self._lock, self.took_over = MeshLock.take(self.state_dir, self.spec.edge_address)
            # What a killed mesh left describes processes that are gone: `status` must not
            # read it as this mesh's while this one starts (both are written again).
            self.endpoints_path.unlink(missing_ok=True)
            self.fleet_status_path.unlink(missing_ok=True)
        return self.took_over

    def start(self, timeout_s: float = 180.0) -> None:
        """Bring every part up and return once all report SERVING and Envoy is ready."""
        deadline = time.monotonic() + timeout_s
        # Outside the try below: a start refused here must not stop (or clean up after)
        # the mesh that holds the state dir.
        self.hold_state_dir()
        try:
            secure_state_dir(self.state_dir)
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            # Its imports overlap with Redis, the certificates and Envoy's config.
            self.supervisor.prepare_fork_server()
            if self.spec.network.mode == "netns":
                # Before anything starts: a machine that cannot says why at once.
                can, why = netns_available()
                if not can:
                    raise MeshStartError(f"zones in network namespaces are not possible: {why}")
            if self.spec.embedded_redis_port is not None:
                self._start_redis(self.spec.embedded_redis_port, deadline)
            # Before any service starts: each reads it once, at start.
            ensure_control_token(self.state_dir)
            # The mesh CA and a certificate per service, Envoy and the operator's tools
            # (kept across runs; renewed when their life runs low or their names change).
            issue_mesh_certificates(self.spec)
            atomic_write_text(self.resolved_spec_path, dump_spec(self.spec))
            self._isolate_model_servers()
            # The trace store and the registry boot side by side, while Envoy's config is
            # rendered and validated: neither calls the other at start, and the registry's
            # first spans (the seeding's) come only once both are ready.
            first = self._start_trace_store()
            self._write_envoy_config()
            if self.spec.network.mode == "netns":
                self._join_zone_network()
            self._start_service("registry-0")
            self.supervisor.wait_ready([*first, "registry-0"], deadline)
            if self.spec.demo.enabled:
                asyncio.run(self._seed())
            # The zones' mirrors of the registry, each ready after its first pull from it,
            # before any model server that may need one.
            mirrors = self._start_registry_mirrors()
            later = [i.name for i in self.spec.instances() if i.service != "registry"]
            self.supervisor.wait_ready(mirrors, deadline)
            for name in later:
                self._start_service(name)
            # A gateway is SERVING only once its zone's mesh listener (Envoy's) accepts
            # connections: wait for it after Envoy, whose own readiness needs one of them.
            gateways = [n for n in later if self.spec.instance(n).service == "gateway"]
            self.supervisor.wait_ready([n for n in later if n not in gateways], deadline)
            self._start_envoy(deadline)
            self.supervisor.wait_ready(gateways, deadline)
            self._start_prometheus(deadline)
            self._start_streams(deadline)
            self._start_batch_scheduler(deadline)
            self._start_scaler(deadline)
            self._write_endpoints()
            self._start_fleet_follower()
            self._start_liveness_watch()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every child, newest tier first; SIGKILL what outlives the grace period.
        Then remove the zones' namespaces (after the processes inside them)."""
        try:
            # First: nothing may start a replica while the mesh stops. Every replica the
            # follower started is a child of the supervisor, so stop_all stops it by PID.
            self._stop_fleet_follower()
            if self.liveness is not None:
                self.liveness.stop()
                self.liveness = None
            if self._quarantines is not None:
                # A quarantine under way finishes while Envoy still runs to confirm it.
                self._quarantines.shutdown(wait=True, cancel_futures=True)
                self._quarantines = None
            self.supervisor.stop_all(STOP_ORDER)
            self.supervisor.close()
        finally:
            if self.network is not None:
                self.network.close()
            # Only the mesh that holds the state dir cleans it (a refused start must leave
            # the running mesh's files alone); the lock goes last, once all is stopped.
            if self._lock is not None:
                self.endpoints_path.unlink(missing_ok=True)
                self.fleet_status_path.unlink(missing_ok=True)
                self._lock.release()
                self._lock = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- operations used by tests and drills ---------------------------------------

    @property
    def children(self) -> Mapping[str, Child]:
        """Every process of the mesh by name (redis, envoy, registry-0, model-fraud-zone-a-0...)."""
        return self.supervisor.children

    def is_running(self, name: str) -> bool:
        return self.supervisor.is_running(name)

    def pid(self, name: str) -> int:
        return self.supervisor.pid(name)

    def pids(self) -> dict[str, int]:
        return self.supervisor.pids()

    def pids_of(self, service: str, zone: str | None = None) -> dict[str, int]:
        """PIDs of the running instances of `service` (in `zone`, or every zone)."""
        return {
            inst.name: self.pid(inst.name)
            for inst in self.spec.instances()
            if inst.service == service
            and (zone is None or inst.zone == zone)
            and self.is_running(inst.name)
        }

    def send_signal(self, name: str, sig: signal.Signals) -> int:
        """Send `sig` to a running process of the mesh (SIGSTOP, SIGCONT...); its PID."""
        return self.supervisor.send_signal(name, sig)

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL, *, revive: bool = False) -> int:
        """Signal a process (SIGKILL by default) and wait until a SIGKILL or SIGTERM took
        effect; returns its PID.

        A deliberate outage (a drill's, a test's): the process stays down until restart(),
        though the mesh starts crashed processes again by itself. `revive=True` asks for
        the crash path instead: the mesh starts it again after its backoff and counts the
        restart (a drill of the mesh's own recovery, e.g. a zone's Envoy killed)."""
        pid = self.supervisor.kill(name, sig, hold=not revive)
        self._status_changed()
        return pid

    def restart(self, name: str, timeout_s: float = 60.0) -> int:
        """Start a stopped service instance again, wait until it is SERVING; its new PID.
        Deliberate: not counted as a restart, and it ends any hold or pending backoff."""
        with self._restart_lock:
            self._crashed.pop(name, None)
            self._reviving.pop(name, None)
            if name in self.supervisor.children:
                self.supervisor.restart(name, wait=False)
            else:
                self._start_service(name)
            self._restarts.started(name)
        self._status_changed()
        self.supervisor.wait_ready([name], time.monotonic() + timeout_s)
        return self.pid(name)

    def restart_counts(self) -> dict[str, int]:
        """How often the mesh started each process again after it exited unexpectedly."""
        with self._restart_lock:
            return {name: r.restarts for name, r in self._restarts.snapshot().items()}

    def reap_exited(self) -> list[Child]:
        """Processes that exited on their own since the last call (now forgotten), but for
        those the mesh starts again itself (REVIVED_KINDS, the per-zone layout's Envoys),
        held down by kill() or not: restart() needs them known."""
        return self.supervisor.reap(keep=self._revives)

    def endpoints(self) -> dict[str, object]:
        spec = self.spec
        return {
            "edge": spec.edge_address,
            # Every zone's edge, the first zone's first (one with proxy.edges one): what
            # callers are given (docs/architecture.md, "Calling the mesh").
            "edges": spec.edge_addresses,
            "mesh": spec.mesh_address,
            "mesh_by_zone": {zone: spec.mesh_address_for(zone) for zone in spec.zones},
            # Envoy's admin API: a Unix socket only this user can reach (AdminClient). The
            # edge's; with an Envoy per zone, each one's by name in envoy_admins.
            "envoy_admin": str(admin_socket_path(self.state_dir)),
            "envoy_admins": {p: str(admin_socket_path(self.state_dir, p)) for p in spec.proxies()},
            "redis": spec.feature_store.redis_url,  # never with the password in it
            "redis_password_file": spec.feature_store.password_file,
            "services": {i.name: spec.address_of(i.name) for i in spec.instances()},
            "registry_mirrors": {
                zone: spec.registry_mirror_address(zone) for zone in spec.registry_mirror_zones()
            },
            "metrics": {name: spec.metrics_address_of(name) for name in spec.metrics_ports},
            "envoy_stats": f"http://{spec.envoy_stats_address}{ENVOY_STATS_PATH}",
            "envoy_stats_by_proxy": {
                p: f"http://{spec.proxy_stats_address(p)}{ENVOY_STATS_PATH}" for p in spec.proxies()
            },
            "prometheus": spec.prometheus_address if self.prometheus is not None else None,
            "alertmanager": self.alerting.address if self.alerting is not None else None,
            "alert_receiver": (
                self.alerting.receiver_address if self.alerting is not None else None
            ),
            "trace_store": spec.tracing.otlp_endpoint if spec.tracing.enabled else None,
            "logs": str(self.logs_dir),
            "tls": self._tls_files(),
            "pids": self.pids(),
        }

    def _tls_files(self) -> dict[str, object]:
        """What a client needs to dial the mesh: the CA to trust, and for the services'
        own ports the operator's certificate (grpcurl -cacert/-cert/-key)."""
        identity = mesh_identity(self.spec)
        if not identity.exists(OPERATOR_IDENTITY):
            return {}
        operator = identity.current(OPERATOR_IDENTITY)
        return {
            "edge": self.spec.tls.edge,
            "trust": str(identity.trust_file),
            "operator_cert": str(operator / "cert.pem"),
            "operator_key": str(operator / "key.pem"),
        }

    def registry_channel(self) -> grpc.aio.Channel:
        """A channel to the registry that carries artifacts up to the spec's message limit."""
        options = message_size_options(self.spec.limits.max_message_bytes)
        return dial_registry(self.spec).aio_channel(options=options)

    # --- the fleet: model servers started and stopped as the resolved spec says -------

    @property
    def fleet_status_path(self) -> Path:
        return self.state_dir / FLEET_STATUS_FILE

    def _start_fleet_follower(self) -> None:
        """Follow the resolved spec's `fleet` from now on, in a thread of the mesh's own.

        A blue-green or rolling update (servemesh.rollout.fleet, in another process) writes
        the fleet it wants into the resolved spec; this process, which owns every child,
        starts the replicas it adds, restarts those whose generation went up and stops those
        it drops, by PID. On the same thread, every process that exits unexpectedly is
        started again after its crash-loop backoff (`_revive_crashed`)."""
        self._fleet = self._fleet_generations(self.spec)
        self._write_fleet_status()
        self._fleet_stop.clear()
        self._fleet_thread = threading.Thread(
            target=self._follow_fleet, name="mesh-fleet", daemon=True
        )
        self._fleet_thread.start()

    def _stop_fleet_follower(self) -> None:
        self._fleet_stop.set()
        if self._fleet_thread is not None:
            self._fleet_thread.join()
            self._fleet_thread = None

    @staticmethod
    def _fleet_generations(spec: ResolvedSpec) -> dict[str, int]:
        """Every replica the fleet may add or drop (all but the registry): model servers,
        and the gateways and feature services the scaler sizes."""
        return {
            inst.name: spec.fleet.generations.get(inst.name, 0)
            for inst in spec.instances()
            if inst.service != "registry"
        }

    def _follow_fleet(self) -> None:
        seen: tuple[int, int] | None = None
        while not self._fleet_stop.wait(FLEET_POLL_S):
            try:
                self._revive_crashed()
            except Exception:  # never let one bad revival end the fleet's follower
                log.exception("could not start a crashed process again")
            try:
                stat = self.resolved_spec_path.stat()
            except OSError:
                continue
            # Every writer renames a new file into place: a new inode or mtime is a change.
            stamp = (stat.st_ino, stat.st_mtime_ns)
            if stamp == seen:
                continue
            seen = stamp
            try:
                spec = load_resolved(self.resolved_spec_path)
            except SpecError as exc:
                log.warning("fleet: the resolved spec does not load, kept as is: %s", exc)
                continue
            try:
                self.follow_fleet(spec)
            except Exception:  # a replica that would not start: say so, keep following
                log.exception("fleet: could not follow the resolved spec")

    def follow_fleet(self, spec: ResolvedSpec) -> None:
        """Make the running replicas match `spec.fleet`: start the new, restart the
        renewed (SIGTERM and its drain first), stop the dropped. Does not wait for the new
        ones to be ready: whoever changed the fleet waits for what it needs."""
        wanted = self._fleet_generations(spec)
        new = [name for name in wanted if name not in self._fleet]
        renewed = [n for n in wanted if n in self._fleet and wanted[n] != self._fleet[n]]
        dropped = [name for name in self._fleet if name not in wanted]
        self.spec = spec  # the running truth from now on (ports of new replicas included)
        if not (new or renewed or dropped):
            return
        if new:
            issue_mesh_certificates(spec)  # the new replicas' identities
        for name in renewed:
            if name in self.supervisor.children:
                log.info("fleet: replacing %s (pid %d)", name, self.pid(name))
                self.supervisor.stop(name)
            self._forget_restarts(name)  # a new generation: a history of its own
            self._start_service(name)
            self._fleet[name] = wanted[name]
            self._write_fleet_status()
        for name in new:
            log.info("fleet: starting %s", name)
            self._start_service(name)
            self._fleet[name] = wanted[name]
        for name in dropped:
            if name in self.supervisor.children:
                log.info("fleet: stopping %s (pid %d)", name, self.pid(name))
                self.supervisor.stop(name)
            self._forget_restarts(name)
            del self._fleet[name]
        self._write_fleet_status()
        self._write_endpoints()
        if self.prometheus is not None:
            self.prometheus.write_targets(spec)

    def _revives(self, child: Child) -> bool:
        """Whether the mesh starts `child` again when it exits unexpectedly: a service
        (REVIVED_KINDS), or an Envoy of the per-zone layout (one zone's, or the edge's), so
        a crash costs its replica or zone seconds."""
        if child.launch.group in REVIVED_KINDS:
            return True
        return self.spec.proxy.layout == "per_zone" and child.name in self._envoy_names()

    def _envoy_names(self) -> set[str]:
        return {envoy_child(p) for p in self.spec.proxies()}

    def _restart_policy(self, name: str) -> RestartPolicy:
        return ENVOY_RESTARTS if name in self._envoy_names() else SERVICE_RESTARTS

    def _revive_crashed(self) -> None:
        """One round of the mesh's watch: every process that exited unexpectedly gets its
        restart scheduled (backoff), and is started once that is due, without waiting for
        it to be ready (the next rounds check that), so one slow start delays no other.

        Never started again: what the supervisor stopped (`stopped`: the mesh stopping,
        the fleet replacing or dropping a replica), and what kill() holds down (a drill's
        outage) until restart(). A paused process (SIGSTOP) has not exited."""
        changed = False
        for name, child in list(self.supervisor.children.items()):
            if child.alive() or child.stopped or child.held or not self._revives(child):
                continue
            changed |= self._revive(name, child)
        changed |= self._check_revived()
        if changed:
            self._write_fleet_status()

    def _revive(self, name: str, child: Child) -> bool:
        """Schedule or perform the restart of one exited process; whether anything changed."""
        with self._restart_lock:
            # Again under the lock: a drill's kill() or restart() may have come between.
            if self.supervisor.children.get(name) is not child or child.held or child.stopped:
                return False
            changed = False
            if self._crashed.get(name) is not child:
                self._crashed[name] = child
                self._reviving.pop(name, None)
                delay = self._restarts.exited(name, child.returncode)
                cause = self._liveness_kills.pop(name, None)
                if cause is None:
                    self._exit_causes.pop(name, None)
                else:
                    self._exit_causes[name] = f"liveness: {cause}"
                if child.launch.group == "model" and child.returncode:
                    self._attribute_crash(name, child.returncode)
                log.warning(
                    "%s (pid %d) exited unexpectedly with %s; starting it again in %.0f s",
                    name,
                    child.pid,
                    child.returncode,
                    delay,
                )
                changed = True
            if not self._restarts.due(name):
                return changed
            try:
                new = self.supervisor.restart(name, wait=False)
            except ProcessError as exc:  # could not even fork: back off as for a crash
                log.error("%s did not start again: %s", name, exc)
                self._restarts.exited(name, child.returncode)
                return changed
            del self._crashed[name]
            self._restarts.restarted(name)
            self._reviving[name] = (new, time.monotonic() + REVIVE_READY_TIMEOUT_S)
            log.warning("%s started again (pid %d)", name, new.pid)
            return True

    def _attribute_crash(self, name: str, status: int) -> None:
        """A model server crashed (a signal, or a non-zero exit; a deliberate stop or
        kill() never comes here): record what its in-flight journal says it was computing
        (<state_dir>/crashes.jsonl), and quarantine the versions its crashes keep naming
        (servemesh.quarantine), before its next process starts a journal of its own."""
        path = journal_path(self.state_dir, name)
        try:
            inflight = read_inflight(path)
            discard(path)
        except OSError as exc:
            log.error("%s: its in-flight journal could not be read: %s", name, exc)
            inflight = []
        try:
            pool = self.spec.instance(name).pool
        except SpecError:
            pool = ""
        quarantine = self._quarantine()
        try:
            due = quarantine.record_crash(name, pool, status, inflight)
        except OSError as exc:
            log.error("%s: the crash could not be recorded: %s", name, exc)
            return
        calls = [(b.get("model"), b.get("version"), len(b.get("calls", ()))) for b in inflight]
        log.warning("%s crashed with %s; in flight: %s", name, status, calls or "nothing")
        if due:
            if self._quarantines is None:
                self._quarantines = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="mesh-quarantine"
                )
            for model, version in due:
                self._quarantines.submit(self._run_quarantine, quarantine, model, version)

    def _quarantine(self) -> Quarantine:
        manager = RouteManager(self.paths)
        return Quarantine(
            self.state_dir,
            self.spec.sandbox.quarantine,
            lambda model, version, reason: move_traffic_away(
                manager, model, version, reason, self.state_dir
            ),
        )

    @staticmethod
    def _run_quarantine(quarantine: Quarantine, model: str, version: str) -> None:
        try:
            if quarantine.quarantine(model, version):
                log.warning("quarantined %s %s: %s", model, version, "its traffic moved")
        except Exception:  # never let a quarantine end the mesh's own threads
            log.exception("quarantine of %s %s failed", model, version)

    def _check_revived(self) -> bool:
        """One readiness check of each process started again and not yet ready (a check
        answers within its own short timeout); whether any finished waiting."""
        done = False
        for name, (child, deadline) in list(self._reviving.items()):
            if self.supervisor.children.get(name) is not child or not child.alive():
                ready, late = False, False  # replaced, or exited again: the next round sees it
            else:
                ready = child.ready is None or child.ready.check()
                late = not ready and time.monotonic() > deadline
                if late:
                    description = child.ready.description if child.ready else "ready"
                    log.error("%s started again but is not %s yet", name, description)
                elif ready:
                    log.warning("%s is ready again (pid %d)", name, child.pid)
            if ready or late or self.supervisor.children.get(name) is not child:
                if child.ready is not None:
                    child.ready.close()
                with self._restart_lock:
                    if self._reviving.get(name, (None,))[0] is child:
                        del self._reviving[name]
                done = True
        return done

    def _forget_restarts(self, name: str) -> None:
        with self._restart_lock:
            self._restarts.forget(name)
            self._exit_causes.pop(name, None)
            self._liveness_kills.pop(name, None)
            self._crashed.pop(name, None)
            self._reviving.pop(name, None)

    def _status_changed(self) -> None:
        """Rewrite the fleet status after a change made outside the fleet's thread (a
        drill's kill or restart), while the mesh runs."""
        if self._fleet_thread is not None:
            self._write_fleet_status()

    def _state_of(self, name: str) -> str:
        """What the fleet status says a process is doing: running, restarting (exited,
        the mesh starts it again), held (killed on purpose, until restart()), exited."""
        child = self.supervisor.children.get(name)
        if child is None:
            return "stopped"
        if child.alive():
            return "running"
        if child.held:
            return "held"
        if not child.stopped and self._revives(child):
            return "restarting"
        return "exited"

    def _restart_fields(self, name: str, records: Mapping[str, RestartRecord]) -> dict[str, object]:
        record = records.get(name, RestartRecord())
        return {
            "state": self._state_of(name),
            "restarts": record.restarts,
            "last_exit": record.last_exit,
            # Set when the mesh itself ended that process (a failed liveness), else null.
            "last_cause": self._exit_causes.get(name),
        }

    # --- liveness: model servers that run but answer nothing are started again ---------

    def _start_liveness_watch(self) -> None:
        settings = self.spec.sandbox.liveness
        if not settings.enabled:
            return
        policy = LivenessPolicy(
            period_s=settings.period_s, timeout_s=settings.timeout_s, failures=settings.failures
        )
        self.liveness = LivenessWatch(policy, self._liveness_targets, self._kill_unresponsive)
        self.liveness.start()

    def _liveness_targets(self) -> list[Target]:
        """Every model server running now and not on its way down or held by a drill."""
        with self._restart_lock:
            children = list(self.supervisor.children.items())
        return [
            Target(name, child.pid, dial_service(self.spec, name))
            for name, child in children
            if child.launch.group == "model" and child.alive() and not (child.stopped or child.held)
        ]

    def _kill_unresponsive(self, name: str, pid: int, reason: str) -> None:
        """SIGKILL a model server that failed its liveness (the same process the probes
        judged); the fleet's thread starts it again with crash-loop backoff, and its in-flight
        calls are recorded as for any crash (a model that hangs its server keeps being
        quarantined like one that crashes it)."""
        with self._restart_lock:
            child = self.supervisor.children.get(name)
            if child is None or child.pid != pid or not child.alive():
                return
            if child.stopped or child.held:
                return
            log.error("%s (pid %d): %s; killing it so it starts again", name, pid, reason)
            self._liveness_kills[name] = reason
            self.supervisor.kill(name, signal.SIGKILL, hold=False)

    def _write_fleet_status(self) -> None:
        """The fleet status file (servemesh.rollout.fleet.fleet_status, `servemesh fleet
        show`): every replica of the fleet by instance, and the mesh's other processes it
        starts again (registry, trace store, per-zone Envoys) under `processes`, each with
        its state, its restarts after unexpected exits and the last such exit's status."""
        with self._restart_lock:
            pids = self.pids()
            records = self._restarts.snapshot()
            status = {
                "instances": {
                    name: {
                        # Every replica's name starts with its kind (spec.instance_name).
                        "service": name.split("-", 1)[0],
                        "generation": generation,
                        "pid": pids.get(name),
                        **self._restart_fields(name, records),
                    }
                    for name, generation in sorted(self._fleet.items())
                },
                "processes": {
                    name: {
                        "service": child.launch.group,
                        "pid": child.pid,
                        **self._restart_fields(name, records),
                    }
                    for name, child in sorted(self.supervisor.children.items())
                    if name not in self._fleet and self._revives(child)
                },
            }
            atomic_write_text(self.fleet_status_path, json.dumps(status, indent=2))

    # --- internals -----------------------------------------------------------------

    def _start_service(self, name: str) -> None:
        """Start an instance without waiting; supervisor.wait_ready waits for SERVING."""
        instance = self.spec.instance(name)
        argv = [
            sys.executable,
            "-m",
            SERVICE_MODULES[instance.service],
            "--spec",
            str(self.resolved_spec_path),
            "--instance",
            name,
        ]
        run_as = self.pool_user(instance.pool) if instance.service == "model" else None
        if run_as is not None:
            # Its own pair readable by its user (a replica the fleet added included), and
            # the files it writes its own.
            share_identity(mesh_identity(self.spec), [name], run_as)
            own_written(self.state_dir, name, run_as)
        if self.network is not None and instance.service != "registry":
            # `ip netns exec` needs root: the user changes inside the namespace, in the
            # setpriv that drops the capabilities (servemesh.procs.netns.drop_privileges_argv).
            death_signal = self.supervisor.death_signal if run_as is not None else None
            argv = self.network.exec_argv(
                instance.zone, argv, run_as=run_as, death_signal=death_signal
            )
            run_as = None
        ready = GrpcHealth(dial_service(self.spec, name))
        self.supervisor.start(
            name,
            argv,
            group=instance.service,
            ready=ready,
            timeout_s=None,
            env=self._control_env(instance.service),
            run_as=run_as,
        )

    def _control_env(self, service: str) -> dict[str, str]:
        """A service with control methods gets the control token's digest to check calls
        against, never the token; the gateway (no control method) gets nothing."""
        if service == "gateway":
            return {}
        return {CONTROL_VERIFIER_ENV: token_digest(ensure_control_token(self.state_dir))}

    def pool_user(self, pool: str) -> RunAs | None:
        """The user a pool's model servers run as: a user of its own for each pool when the
        mesh picks the users itself (`sandbox.model_user: auto`), else the one user named
        (None: the mesh's own user)."""
        if self.model_user is None:
            return None
        if self.spec.sandbox.model_user != "auto":
            return self.model_user
        return pool_users(self.model_user, self.spec.pool_names()).get(pool, self.model_user)

    def _isolate_model_servers(self) -> None:
        """Private again whatever an earlier run left open; then, when model servers run as
        a user of their own (root only: servemesh.procs.sandbox), share with that user's
        group exactly what they read (servemesh.state.sharing)."""
        tighten(self.state_dir)
        self.model_user, why = model_user(self.spec.sandbox.model_user, self.state_dir)
        (log.warning if "not isolated" in why else log.info)(why)
        if self.model_user is not None:
            share_with_models(
                self.state_dir, self.resolved_spec_path, mesh_identity(self.spec), self.model_user
            )

    def _start_trace_store(self) -> list[str]:
        """Start the embedded OTLP receiver (`servemesh.tracestore`), when the spec names no
        collector, without waiting; the names to wait for before any service exports."""
        port = self.spec.embedded_trace_store_port
        if port is None:
            return []
        argv = [sys.executable, "-m", "servemesh.tracestore", "--spec"]
        address = f"{self.spec.host}:{port}"
        ready = GrpcHealth(dial_address(self.spec, address, TRACE_STORE_IDENTITY))
        self.supervisor.start(
            TRACE_STORE, [*argv, str(self.resolved_spec_path)], ready=ready, timeout_s=None
        )
        return [TRACE_STORE]

    def _start_registry_mirrors(self) -> list[str]:
        """Start each zone's mirror of the registry (registry.mirrors), without waiting; the
        names to wait for. It runs where the registry does (on the machine, outside the
        zones' namespaces), pulling from it with its own certificate."""
        names = []
        for zone in self.spec.registry_mirror_zones():
            name = registry_mirror_name(zone)
            address = self.spec.registry_mirror_address(zone)
            assert address is not None, "resolved with the mirror's zone"
            argv = [sys.executable, "-m", "servemesh.registry.mirror", "--spec"]
            argv += [str(self.resolved_spec_path), "--instance", name]
            ready = GrpcHealth(dial_address(self.spec, address, name))
            self.supervisor.start(
                name,
                argv,
                group=REGISTRY_MIRROR_GROUP,
                ready=ready,
                timeout_s=None,
                env=self._control_env("registry"),
            )
            names.append(name)
        return names

    def _start_redis(self, port: int, deadline: float) -> None:
        password_file = self.spec.feature_store.password_file
        self.redis = RedisServer(
            self.supervisor,
            self.state_dir / "redis",
            host=self.spec.host,
            port=port,
            password_file=Path(password_file) if password_file else None,
            # Writes to strings published as keyspace events: the feature services' change
            # feed (services/feature/changes.py) for caches that answer without a read.
            settings=(KEYSPACE_EVENTS,),
            replicated=self.spec.feature_store.topology == "replicated",
        )
        self.redis.start(timeout_s=max(0.0, deadline - time.monotonic()))
        if self.spec.feature_store.topology == "replicated":
            self._start_store_replicas(deadline)

    def _start_store_replicas(self, deadline: float) -> None:
        """A replicated store: the primary (started) persists, a replica per zone follows
        it, and a Sentinel per zone watches it. Every server gets the primary's settings:
        Sentinel may promote any of them."""
        spec, primary = self.spec, self.redis
        assert primary is not None
        store = spec.feature_store
        primary_at = f"{primary.host} {primary.port}"
        for zone in spec.zones:
            replica = RedisServer(
                self.supervisor,
                self.state_dir / f"redis-replica-{zone}",
                host=spec.host,
                port=spec.store_ports[f"replica-{zone}"],
                name=f"redis-replica-{zone}",
                password_file=primary.password_path,
                settings=primary.settings,
                replicated=True,
                replica_of=primary_at,
            )
            replica.start(timeout_s=max(0.0, deadline - time.monotonic()))
            self.store_replicas[zone] = replica
        # One per zone, and the witness (feature_store.witness_sentinel) where the mesh
        # resolved a port for it.
        ports = spec.sentinel_ports
        for name, port in ports.items():
            sentinel = SentinelServer(
                self.supervisor,
                self.state_dir / f"redis-{name}",
                primary=primary_at,
                password_file=primary.password_path,
                quorum=quorum_of(len(ports)),
                down_after_ms=store.sentinel_down_after_ms,
                failover_timeout_ms=store.sentinel_failover_timeout_ms,
                host=spec.host,
                port=port,
                name=f"redis-{name}",
            )
            sentinel.start(timeout_s=max(0.0, deadline - time.monotonic()))
            self.sentinels[name.removeprefix("sentinel-")] = sentinel

    def _join_zone_network(self) -> None:
        """Create the zones' namespaces and join them to the machine's loopback: each
        zone's service and metrics ports lead into its namespace; out of a zone lead only
        the ports its services call: the registry (model servers), Redis (feature
        services), the trace store, and that zone's Envoy mesh listener (gateways) where it
        runs on the machine (the shared layout).

        In the per-zone layout each zone's Envoy runs inside its zone: its mesh listener
        and stats port lead into the zone from the machine (the edge's and the operator's
        tools, Prometheus), and it reaches the other zones' feature and model replicas
        straight across the zones' bridge (`join_zones`), so a partition cuts those
        calls."""
        spec = self.spec
        own_envoy = spec.proxy.layout == "per_zone"
        zone_ports: dict[str, list[int]] = {zone: [] for zone in spec.zones}
        replica_ports: dict[str, list[int]] = {zone: [] for zone in spec.zones}
        for inst in spec.instances():
            if inst.service != "registry":
                zone_ports[inst.zone].append(spec.port_of(inst.name))
                if inst.name in spec.metrics_ports:
                    zone_ports[inst.zone].append(spec.metrics_ports[inst.name])
            if inst.service in ("feature", "model"):
                replica_ports[inst.zone].append(spec.port_of(inst.name))
        shared = [spec.port_of("registry-0")]
        if spec.embedded_trace_store_port is not None:
            shared.append(spec.embedded_trace_store_port)
        redis_port = urllib.parse.urlparse(spec.redis_url).port
        if redis_port:
            shared.append(redis_port)
        # A replicated store's replicas and Sentinels (the zones reach every one: a zone's
        # services ask any Sentinel, and write to whichever server is the primary).
        shared += spec.store_ports.values()
        if own_envoy:
            for zone in spec.zones:
                zone_ports[zone] += [spec.mesh_ports[zone], spec.proxy_stats_port(zone)]
            host_ports = {zone: list(shared) for zone in spec.zones}
        else:
            host_ports = {zone: [spec.mesh_ports[zone], *shared] for zone in spec.zones}
        self.network = ZoneNetwork(list(spec.zones)).create()
        self.network.attach_host(zone_ports, host_ports)
        if own_envoy:
            self.network.join_zones(replica_ports)

    def _write_envoy_config(self) -> None:
        """For each of the mesh's Envoys: validate its whole config inline, then write its
        watched files and its bootstrap."""
        for proxy, resources in render_proxies(self.spec, self.logs_dir).items():
            config = self.paths.envoy_config_of(proxy)
            static = config.with_name(f"{config.stem}.static.yaml")
            static.parent.mkdir(parents=True, exist_ok=True)
            bootstrap = static_bootstrap(self.spec, resources, self.logs_dir, proxy)
            static.write_text(dump_yaml(bootstrap))
            validate_config(static)
            layout = self.paths.xds_of(proxy)
            write_initial(self.spec, resources, layout)
            running = dynamic_bootstrap(self.spec, resources, layout, self.logs_dir, proxy)
            config.write_text(dump_yaml(running))
            validate_config(config)

    def _start_envoy(self, deadline: float) -> None:
        """The zones' Envoys first (per-zone layout): a gateway is SERVING only once its
        zone's mesh listener accepts connections, and the edge's readiness needs one."""
        proxies = self.spec.proxies()
        edges = self.spec.edge_proxies()
        zones = [p for p in proxies if p not in edges]
        for proxy in zones:
            self._start_one_envoy(proxy)
        self.supervisor.wait_ready([envoy_child(p) for p in zones], deadline)
        for proxy in edges:
            self._start_one_envoy(proxy)
        self.supervisor.wait_ready([envoy_child(p) for p in edges], deadline)

    def _start_one_envoy(self, proxy: str) -> None:
        """Start one of the mesh's Envoys without waiting. Its --base-id (its shared-memory
        name): ports.envoy_admin for the first, the ones after it in spec.proxies()' order."""
        base_id = self.spec.ports.envoy_admin + self.spec.proxies().index(proxy)
        argv = envoy_command(self.paths.envoy_config_of(proxy), base_id=base_id)
        edge = is_edge_proxy(proxy)
        if self.network is not None and not edge:
            argv = self.network.exec_argv(proxy, argv)  # a zone's Envoy runs in its zone
        admin = prepare_admin_dir(self.state_dir, proxy)
        checks: list[Readiness] = [Check(lambda: is_ready(admin), f"Envoy admin at {admin} ready")]
        if edge:
            # Ready means Envoy finished its first health-check round; then confirm the edge
            # path end to end: Envoy -> a gateway answering SERVING.
            checks.append(GrpcHealth(dial_edge_at(self.spec, self.spec.edge_address_of(proxy))))
        self.supervisor.start(
            envoy_child(proxy),
            argv,
            group="envoy",
            ready=All(*checks),
            timeout_s=None,
        )

    def _start_streams(self, deadline: float) -> None:
        """A consumer process per entry of the spec's `streams` (python -m servemesh.streams),
        once the edge answers; ready when its group exists (it writes its ready file)."""
        for stream in self.spec.streams:
            ready = self.state_dir / "streams" / f"{stream.name}.ready"
            ready.unlink(missing_ok=True)
            argv = [sys.executable, "-m", "servemesh.streams", "--spec"]
            argv += [str(self.resolved_spec_path), "--name", stream.name]
            self.supervisor.start(
                f"stream-{stream.name}",
                argv,
                group="stream",
                ready=Check(ready.exists, f"stream {stream.name}: consumer ready ({ready})"),
                timeout_s=max(0.0, deadline - time.monotonic()),
            )

    def _start_batch_scheduler(self, deadline: float) -> None:
        """The spec's `batch:` jobs, run when due (servemesh.batch.scheduler), when it has
        any; ready once it wrote its ready file (before its first round)."""
        if not self.spec.batch:
            return
        from servemesh.batch.schedule import ready_path

        ready = ready_path(self.state_dir)
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "servemesh.batch.scheduler"]
        argv += ["--state-dir", str(self.state_dir)]
        self.supervisor.start(
            "batch-scheduler",
            argv,
            group="batch",
            ready=Check(ready.exists, f"batch scheduler ready ({ready})"),
            timeout_s=max(0.0, deadline - time.monotonic()),
        )

    def _start_scaler(self, deadline: float) -> None:
        """The scaler (python -m servemesh.scaling), when asked for and the spec's scaling is
        on; ready once it wrote its ready file (before its first round)."""
        if not self.scaler or not self.spec.scaling.enabled:
            return
        if self.spec.discovery.backend == "dns":
            # Replicas are whoever the names resolve to; the scaler would only hold.
            log.info("scaler not started: discovery.backend dns (the names' owner scales)")
            return
        from servemesh.scaling.__main__ import ready_path

        ready = ready_path(self.state_dir)
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "servemesh.scaling", "--state-dir", str(self.state_dir)]
        self.supervisor.start(
            "scaler",
            argv,
            group="scaler",
            ready=Check(ready.exists, f"scaler ready ({ready})"),
            timeout_s=max(0.0, deadline - time.monotonic()),
        )

    def _start_prometheus(self, deadline: float) -> None:
        """Prometheus scraping every service and Envoy, when the spec wants one and the
        binary is installed; without it the services' own /metrics still answer."""
        binary = prometheus_binary() if self.spec.metrics.prometheus == "auto" else None
        if binary is None:
            if self.spec.metrics.prometheus == "auto":
                log.info("no prometheus binary on PATH: the services' /metrics only")
            return
        self.prometheus = PrometheusServer(
            self.supervisor, self.spec, self.state_dir / "prometheus", binary
        )
        self.alerting = self._start_alerting(deadline)
        if self.alerting is not None:
            self.prometheus.alertmanager = self.alerting.address
        self.prometheus.start(timeout_s=max(0.0, deadline - time.monotonic()))

    def _start_alerting(self, deadline: float) -> Alerting | None:
        """Alertmanager and the mesh's alert receiver, beside Prometheus, when the spec
        wants them and the binary is installed (skipped, saying so, when it is not)."""
        if self.spec.metrics.alertmanager != "auto":
            return None
        binary = alertmanager_binary()
        if binary is None:
            log.info("no alertmanager binary on PATH: alerts are evaluated, not routed")
            return None
        alerting = Alerting(self.supervisor, self.spec, self.state_dir / "alertmanager", binary)
        try:
            alerting.start(timeout_s=max(0.0, deadline - time.monotonic()))
        except ProcessError as exc:
            # Routing alerts is an extra: a mesh that serves without it is better than none.
            log.warning("alerts are evaluated, not routed: %s", exc)
            for name in (ALERTMANAGER_NAME, RECEIVER_NAME):
                if name in self.supervisor.children:
                    self.supervisor.stop(name)
            return None
        return alerting

    async def _seed(self) -> None:
        async with self.registry_channel() as channel:
            for step in (seed_demo, *self.seed_steps):
                try:
                    await step(self.spec, channel)
                except SeedConflict as exc:
                    raise MeshStartError(str(exc)) from None

    def _write_endpoints(self) -> None:
        tmp = self.endpoints_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.endpoints(), indent=2))
        tmp.replace(self.endpoints_path)


def with_edge_credentials(spec: MeshSpec, state_dir: Path) -> MeshSpec:
    """With basic edge auth and no users named, this mesh's key (created once, kept in the
    state dir); the spec, and so Envoy's config, gets only its hash. With jwt edge auth,
    the mesh's token signing key (created once) and the public JWKS Envoy reads."""
    auth = spec.traffic.edge_auth
    if auth.active_mode == "jwt":
        ensure_signing_key(state_dir)
    if auth.active_mode != "basic" or auth.users:
        return spec
    user, key = ensure_edge_credentials(state_dir)
    traffic = spec.traffic.model_copy(
        update={"edge_auth": auth.model_copy(update={"users": [htpasswd_line(user, key)]})}
    )
    return spec.model_copy(update={"traffic": traffic})


@contextmanager
def running_mesh(spec: MeshSpec, state_dir: Path | None = None) -> Iterator[Mesh]:
    mesh = Mesh.from_spec(spec, state_dir)
    mesh.start()
    try:
        yield mesh
    finally:
        mesh.stop()
