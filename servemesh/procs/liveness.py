"""Restarting a child that runs but is dead inside: liveness probes and their verdicts.

A process that exits is the supervisor's to see. A model server whose event loop is
blocked, or whose model thread has been stuck in one call (services/model/checks.py), is
still alive to the kernel: readiness takes it out of Envoy within seconds, but nothing
frees a stuck Python thread short of a new process. So the launcher asks each model server
its `liveness` health name every `period_s`; after `failures` answers in a row that are
late (`timeout_s`) or NOT_SERVING it kills the process, and the mesh's crash-loop backoff
starts it again (servemesh.procs.restarts), exactly as after a crash.

What is never killed for liveness:
- a process that has not answered SERVING once since it started: it is still loading (its
  start has a readiness deadline of its own);
- a process stopped by job control (SIGSTOP: a drill's or an operator's pause). It is not
  hung, it was told to wait, and a kill would turn a pause drill into a crash drill.

`LivenessVerdicts` is the pure bookkeeping (unit-tested without a process); `LivenessWatch`
is the thread that probes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.wire import LIVENESS_HEALTH_NAME
from servemesh.identity.channels import Dial

log = logging.getLogger(__name__)

# Probes of one round run side by side, so one hung server (a probe that waits out its
# timeout) does not delay the verdict on the others.
MAX_PARALLEL_PROBES = 8


@dataclass(frozen=True)
class LivenessPolicy:
    period_s: float = 5.0
    timeout_s: float = 2.0
    failures: int = 3


@dataclass(frozen=True)
class Target:
    """One process to probe: its supervisor name, its PID now, and how to reach it."""

    name: str
    pid: int
    dial: Dial


@dataclass
class _Record:
    pid: int
    # Answered SERVING at least once: from then on a failure counts.
    armed: bool = False
    failures: int = 0


class LivenessVerdicts:
    """Failed probes in a row, per process; says when one is due to be killed."""

    def __init__(self, failures: int) -> None:
        if failures < 1:
            raise ValueError(f"failures counts from 1, not {failures}")
        self.failures = failures
        self._records: dict[str, _Record] = {}

    def observe(self, name: str, pid: int, failure: str | None) -> bool:
        """One probe's outcome for `name` (process `pid`): None when it answered SERVING,
        else why not. True when this failure is the `failures`-th in a row of a process that
        had answered before: kill it. A new PID starts a new record."""
        record = self._records.get(name)
        if record is None or record.pid != pid:
            record = self._records[name] = _Record(pid)
        if failure is None:
            record.armed = True
            record.failures = 0
            return False
        if not record.armed:
            return False
        record.failures += 1
        if record.failures < self.failures:
            return False
        # Disarmed: the same PID is not judged again (it is being killed), and a new one
        # must answer once before its failures count.
        record.armed = False
        record.failures = 0
        return True

    def paused(self, name: str) -> None:
        """`name` is stopped by job control: its failures so far do not count."""
        record = self._records.get(name)
        if record is not None:
            record.failures = 0

    def failures_of(self, name: str) -> int:
        record = self._records.get(name)
        return 0 if record is None else record.failures

    def forget_others(self, names: Iterable[str]) -> None:
        """Drop the records of every process not in `names` (gone from the fleet)."""
        keep = set(names)
        for name in [n for n in self._records if n not in keep]:
            del self._records[name]


def stopped_by_job_control(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, SIGTSTP) or traced: state T or t in /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The command name (in parentheses) may hold spaces; the state follows its last ")".
    state = stat.rpartition(")")[2].split()
    return bool(state) and state[0] in ("T", "t")


def probe_liveness(channel: grpc.Channel, timeout_s: float) -> str | None:
    """None when the server's liveness name answers SERVING in time; else why not."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(
            health_pb2.HealthCheckRequest(service=LIVENESS_HEALTH_NAME), timeout=timeout_s
        )
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no answer within {timeout_s:g} s"
        name = code.name if code else "error"
        return f"{name}: {exc.details()}" if exc.details() else name
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


class LivenessWatch:
    """A thread that probes `targets()` every period and calls `kill(name, pid, reason)`
    for each process due (LivenessVerdicts). `rounds` counts finished rounds (tests wait on
    it instead of on time)."""

    def __init__(
        self,
        policy: LivenessPolicy,
        targets: Callable[[], list[Target]],
        kill: Callable[[str, int, str], None],
    ) -> None:
        self.policy = policy
        self._targets = targets
        self._kill = kill
        self.verdicts = LivenessVerdicts(policy.failures)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channels: dict[str, tuple[int, grpc.Channel]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._rounds = 0
        self._round_done = threading.Condition()

    @property
    def rounds(self) -> int:
        with self._round_done:
            return self._rounds

    def wait_rounds(self, count: int, timeout_s: float) -> bool:
        """Wait until `count` rounds have finished in all; whether they did in time."""
        with self._round_done:
            return self._round_done.wait_for(lambda: self._rounds >= count, timeout=timeout_s)

    def start(self) -> None:
        self._stop.clear()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=MAX_PARALLEL_PROBES, thread_name_prefix="mesh-liveness-probe"
        )
        self._thread = threading.Thread(target=self._run, name="mesh-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for _, channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.policy.period_s):
            try:
                self.run_round()
            except Exception:  # a bug here must not end the watch for good
                log.exception("liveness: a round of probes failed")
            with self._round_done:
                self._rounds += 1
                self._round_done.notify_all()

    def run_round(self) -> None:
        """Probe every target once and act on the verdicts."""
        targets = self._targets()
        names = {t.name for t in targets}
        self.verdicts.forget_others(names)
        for name in [n for n in self._channels if n not in names]:
            self._channels.pop(name)[1].close()
        live = []
        for target in targets:
            if stopped_by_job_control(target.pid):
                self.verdicts.paused(target.name)
            else:
                live.append(target)
        assert self._pool is not None
        timeout_s = self.policy.timeout_s
        futures = {t: self._pool.submit(probe_liveness, self._channel(t), timeout_s) for t in live}
        for target, future in futures.items():
            failure = future.result()
            if self.verdicts.observe(target.name, target.pid, failure):
                reason = f"{self.policy.failures} liveness checks failed in a row, last: {failure}"
                self._kill(target.name, target.pid, reason)

    def _channel(self, target: Target) -> grpc.Channel:
        """The channel to `target`'s process: kept between rounds, new for a new PID."""
        known = self._channels.get(target.name)
        if known is None or known[0] != target.pid:
            if known is not None:
                known[1].close()
            known = self._channels[target.name] = (target.pid, target.dial.channel())
        return known[1]
