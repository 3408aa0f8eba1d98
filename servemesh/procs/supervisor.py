"""The children of one owner: started, watched until ready, signalled and stopped by PID."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from servemesh.contract.errors import ServemeshError
from servemesh.procs.ready import Readiness
from servemesh.procs.sandbox import RunAs
from servemesh.procs.spawn import Launch, Process, Spawner

log = logging.getLogger(__name__)

POLL_S = 0.05  # between readiness checks
# Signals that pause or continue a process: it is still there, nothing to hold down.
JOB_CONTROL = frozenset(
    {signal.SIGSTOP, signal.SIGCONT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}
)


class ProcessError(ServemeshError, RuntimeError):
    """A child cannot be started, found or signalled as asked."""


class StartError(ProcessError):
    """A child exited or was not ready in time; the message carries the tail of its log."""


@dataclass
class Child:
    """One started process. Its Launch (and readiness) start it again the same way."""

    launch: Launch
    popen: Process
    ready: Readiness | None = None
    # Set when the owner stopped it (so it did not "exit on its own").
    stopped: bool = field(default=False, repr=False)
    # Set when someone killed it on purpose (kill(): a drill's outage) and wants it to stay
    # down until restart(): an owner that starts crashed children again leaves it alone.
    held: bool = field(default=False, repr=False)

    @property
    def name(self) -> str:
        return self.launch.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout_s: float) -> int:
        """The exit status, once it exited (subprocess.TimeoutExpired after timeout_s)."""
        return self.popen.wait(timeout=timeout_s)

    def log_tail(self, lines: int = 25) -> str:
        if self.launch.log_path is None:
            return "(output discarded)"
        try:
            text = self.launch.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    """Starts named children and stops them by PID: SIGTERM, a grace period, then SIGKILL.

    Children get a parent-death signal (they go when this process dies outright) and a
    session of their own (a terminal's Ctrl-C reaches the owner alone, which stops them in
    order). Use as a context manager, or call close() when done.
    """

    def __init__(
        self,
        logs_dir: Path | None = None,
        *,
        cwd: Path | None = None,
        grace_s: float = 10.0,
        death_signal: signal.Signals = signal.SIGTERM,
        thread_name: str = "spawner",
        forked: Mapping[str, Sequence[str]] | None = None,
        forked_as: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        # Each child logs to <logs_dir>/<name>.log; without logs_dir, output is discarded.
        self.logs_dir = logs_dir
        self.cwd = cwd
        self.grace_s = grace_s
        self.death_signal = death_signal
        # `forked`, `forked_as`: python -m modules forked from a fork server, as this user
        # or as the user they run as (servemesh.procs.spawn).
        self._spawner = Spawner(thread_name, forked=forked, forked_as=forked_as, logs_dir=logs_dir)
        self._children: dict[str, Child] = {}
        self._lock = threading.Lock()

    # --- looking ---------------------------------------------------------------------

    @property
    def children(self) -> Mapping[str, Child]:
        """Every child started and not yet stopped or reaped, by name (read-only)."""
        return MappingProxyType(self._children)

    def child(self, name: str) -> Child:
        try:
            return self._children[name]
        except KeyError:
            known = sorted(self._children)
            raise ProcessError(f"no child named {name!r}; known: {known}") from None

    def is_running(self, name: str) -> bool:
        child = self._children.get(name)
        return child is not None and child.alive()

    def pid(self, name: str) -> int:
        return self.child(name).pid

    def pids(self) -> dict[str, int]:
        with self._lock:  # a fault loop may restart children meanwhile
            return {name: child.pid for name, child in self._children.items()}

    # --- starting --------------------------------------------------------------------

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        group: str | None = None,
        ready: Readiness | None = None,
        timeout_s: float | None = 60.0,
        log: bool = True,
        env: Mapping[str, str] | None = None,
        death_signal: signal.Signals | None = None,
        run_as: RunAs | None = None,
    ) -> Child:
        """Start a child; with `ready`, wait until it is (timeout_s None: do not wait now,
        call wait_ready later). A running child of that name is an error. `run_as`: another
        user the child runs as (servemesh.procs.sandbox)."""
        if self.is_running(name):
            raise ProcessError(f"{name} is already running")
        log_path = self.logs_dir / f"{name}.log" if log and self.logs_dir is not None else None
        launch = Launch(
            name=name,
            argv=tuple(argv),
            group=group or name,
            log_path=log_path,
            cwd=self.cwd,
            env=dict(env or {}),
            death_signal=death_signal or self.death_signal,
            run_as=run_as,
        )
        child = self._launch(launch, ready)
        if ready is not None and timeout_s is not None:
            self.wait_ready([name], time.monotonic() + timeout_s)
        return child

    def restart(self, name: str, timeout_s: float = 60.0, *, wait: bool = True) -> Child:
        """Start a stopped child again as it was first started, and wait until it is ready
        (`wait` False: return at once; its owner checks `child.ready` as it likes)."""
        old = self.child(name)
        if old.alive():
            raise ProcessError(f"{name} is still running")
        child = self._launch(old.launch, old.ready)
        if wait and child.ready is not None:
            self.wait_ready([name], time.monotonic() + timeout_s)
        return child

    def fork_server_pids(self) -> dict[str, int]:
        """The fork servers this supervisor runs (not children it names), by log name."""
        return self._spawner.server_pids()

    def prepare_fork_server(self) -> None:
        """Start the fork server's imports now (when there is one to start), so that they
        overlap with the owner's other work before its first forked service."""
        self._spawner.prepare()

    def _launch(self, launch: Launch, ready: Readiness | None) -> Child:
        popen = self._spawner.spawn(launch)
        child = Child(launch=launch, popen=popen, ready=ready)
        with self._lock:
            self._children[launch.name] = child
        return child

    def wait_ready(self, names: Iterable[str], deadline: float) -> None:
        """Return once every named child is ready (by its readiness); StartError naming the
        child, with its log tail, when one exits first or `deadline` (monotonic) passes."""
        for name in names:
            child = self.child(name)
            if child.ready is None:
                continue
            try:
                while not child.ready.check():
                    if not child.alive():
                        raise StartError(
                            f"{name} exited with {child.returncode} while starting; its log:\n"
                            + child.log_tail()
                        )
                    if time.monotonic() > deadline:
                        raise StartError(
                            f"{name} was not ready in time ({child.ready.description}); "
                            "its log:\n" + child.log_tail()
                        )
                    time.sleep(POLL_S)
            finally:
                child.ready.close()

    # --- signals and stopping ---------------------------------------------------------

    def send_signal(self, name: str, sig: signal.Signals) -> int:
        """Send `sig` to a running child; returns its PID."""
        child = self.child(name)
        if not child.alive():
            raise ProcessError(f"{name} is not running")
        child.popen.send_signal(sig)
        return child.pid

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL, *, hold: bool = True) -> int:
        """Signal a child (SIGKILL by default) and, for SIGKILL or SIGTERM, wait until it
        exited; returns its PID. It stays known, so restart() can start it again.

        A kill is deliberate: with `hold` (the default) the child is marked `held`, so an
        owner that starts crashed children again leaves it down until restart(). A signal
        that pauses or continues (SIGSTOP, SIGCONT...) ends nothing and holds nothing."""
        child = self.child(name)
        if not child.alive():
            raise ProcessError(f"{name} is not running")
        if hold and sig not in JOB_CONTROL:
            # Before the signal: an owner's watch must never see it dead and not yet held.
            child.held = True
        child.popen.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            # This process, not the name's: an owner may have started it again already.
            child.wait(self.grace_s + 5)
        return child.pid

    def stop(self, name: str, grace_s: float | None = None) -> int | None:
        """Stop one child (SIGTERM, grace, SIGKILL) and forget it; returns its exit status."""
        child = self.child(name)
        self._stop_tier([child], self.grace_s if grace_s is None else grace_s)
        with self._lock:
            if self._children.get(name) is child:
                del self._children[name]
        return child.returncode

    def stop_all(self, order: Sequence[Sequence[str]] = ()) -> None:
        """Stop every child, a tier of groups at a time in `order`; children of groups not
        named go last, newest first. Each tier gets SIGTERM, then SIGKILL after the grace."""
        with self._lock:
            remaining = list(self._children.values())
        tiers: list[list[Child]] = []
        for groups in order:
            tiers.append([c for c in remaining if c.launch.group in groups])
            remaining = [c for c in remaining if c.launch.group not in groups]
        tiers.extend([c] for c in reversed(remaining))
        for tier in tiers:
            self._stop_tier(tier, self.grace_s)
        with self._lock:
            self._children.clear()

    def _stop_tier(self, tier: list[Child], grace_s: float) -> None:
        members = [c for c in tier if c.alive()]
        for child in tier:
            child.stopped = True
        for child in members:
            child.popen.send_signal(signal.SIGTERM)
            # A child stopped with SIGSTOP would act on SIGTERM only once continued.
            child.popen.send_signal(signal.SIGCONT)
        for child in members:
            try:
                child.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s outlived its grace period; killing", child.name)
                child.popen.kill()
                child.popen.wait(timeout=5)
        for child in tier:
            if child.popen.returncode is None:
                child.popen.wait(timeout=5)

    def reap(self, keep: Callable[[Child], bool] | None = None) -> list[Child]:
        """Children that exited on their own since the last call (now forgotten); those
        `keep` names stay, for their owner to start again."""
        with self._lock:
            dead = [
                c
                for c in self._children.values()
                if not c.alive() and not c.stopped and not (keep is not None and keep(c))
            ]
            for child in dead:
                del self._children[child.name]
        return dead

    def close(self) -> None:
        """Stop every child (newest first) and end the forking thread. Idempotent."""
        try:
            self.stop_all()
        finally:
            self._spawner.close()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
