"""A rollout's durable state: what the controller did, what operators asked of it, and the
history of every rollout.

Shared by the processes that read or write it: the controller (`servemesh rollout
start|resume`, servemesh.rollout), `servemesh rollout status|pause|abort|promote`, and the
chaos drills that watch a rollout they drive. It holds records only; the controller turns
its own values into them (servemesh.rollout.state).

Layout under `<state_dir>/rollouts/`:

- `<model>.json`: the current (or last) rollout of the model, rewritten atomically at every
  change, so a crash of the controller leaves the last step it recorded and `resume` (or the
  deadline) can take over from there.
- `<model>.lock`: held (flock) by the live controller for its whole life. The kernel drops
  it when the process dies, however it dies, so "is anyone driving this rollout?" needs no
  PID guessing: a PID can be reused, a lock cannot outlive its holder.
- `<model>.update.lock`: held for a moment around each read-modify-write of `<model>.json`,
  so the controller's writes and an operator's flag (pause, abort, promote) never lose
  each other.
- `history.jsonl`: append-only, one JSON event per line (started with its overrides and
  their reasons, each step, pause/resume/abort/promote with who and why, the ending).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.errors import ServemeshError
from servemesh.contract.private import open_lock
from servemesh.spec.rollout_plan import RolloutPlan, Strategy

log = logging.getLogger(__name__)

Status = Literal["running", "promoted", "rolled_back", "refused", "aborted"]
ACTIVE: frozenset[str] = frozenset({"running"})


def who() -> str:
    """The operator (or process) behind a request, for the history."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"


class Request(BaseModel):
    """An operator's request to the running controller: who asked, when, and why."""

    model_config = ConfigDict(extra="forbid")

    who: str
    at: float
    reason: str = ""


class CheckRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    verdict: str
    detail: str


class WindowRecord(BaseModel):
    """An arm's window (servemesh.rollout.types.ArmWindow) as JSON (the last full window of
    the baseline is what the 100% step, where the baseline answers nobody, is judged
    against)."""

    # The last bucket bound is +inf: written as JSON's Infinity, not null.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    version: str
    requests: int
    errors: int
    latency_bounds_s: tuple[float, ...] = ()
    latency_buckets: tuple[int, ...] = ()
    score_bounds: tuple[float, ...] = ()
    score_buckets: tuple[int, ...] = ()


class RolloutState(BaseModel):
    """Everything a controller needs to continue a rollout, and `status` needs to show it."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    id: str
    model: str
    version: str
    baseline: str
    strategy: Strategy
    plan: RolloutPlan
    started_at: float  # wall clock (epoch seconds): survives the process
    started_by: str
    status: Status = "running"
    # Index into plan.steps of the step under way (-1: before the first). It is recorded
    # before its routes change (a controller killed in between applies it again on
    # resume); `step_applied` says Envoy serves it, and `weights`/`shadow` are then what
    # it serves.
    step: int = -1
    step_applied: bool = False
    step_started_at: float | None = None
    weights: dict[str, int] = Field(default_factory=dict)
    shadow: bool = False
    # The controller's PID (informative; liveness is the lock file's business).
    pid: int | None = None
    last_checks: list[CheckRecord] = Field(default_factory=list)
    checked_at: float | None = None
    # Calls callers pinned to each version over the last analysis window (not judged).
    pinned_calls: dict[str, int] = Field(default_factory=dict)
    reference_baseline: WindowRecord | None = None
    overrides: dict[str, str] = Field(default_factory=dict)
    checklist: list[dict[str, Any]] = Field(default_factory=list)
    # Operator requests the controller reads every analysis interval.
    pause: Request | None = None
    abort: Request | None = None
    promote: Request | None = None
    # A strategy's own progress marker (blue-green, rolling), for resume.
    marker: str | None = None
    marker_data: dict[str, Any] = Field(default_factory=dict)
    ended_at: float | None = None
    reason: str = ""

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    @property
    def step_label(self) -> str:
        if self.strategy in ("blue-green", "rolling"):
            # A fleet strategy's steps are its own: its last durable marker says where it is.
            return self.marker or "starting"
        if self.step < 0:
            return "preflight"
        if self.step >= len(self.plan.steps):
            return "done"
        return self.plan.steps[self.step].label


class StateError(ServemeshError, RuntimeError):
    """The state file is unreadable or names another model than expected."""


class StateStore:
    """The rollouts of one mesh, under `<state_dir>/rollouts/`."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "rollouts"

    # --- paths ---------------------------------------------------------------------------

    def state_path(self, model: str) -> Path:
        return self.root / f"{model}.json"

    def lock_path(self, model: str) -> Path:
        return self.root / f"{model}.lock"

    @property
    def history_path(self) -> Path:
        return self.root / "history.jsonl"

    # --- state ---------------------------------------------------------------------------

    def load(self, model: str) -> RolloutState | None:
        path = self.state_path(model)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            return RolloutState.model_validate_json(text)
        except ValueError as exc:
            raise StateError(f"{path}: not a rollout state: {exc}") from None

    def models(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.stem for p in self.root.glob("*.json") if not p.name.startswith("."))

    def save(self, state: RolloutState) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.state_path(state.model), state.model_dump_json(indent=1) + "\n")

    @contextlib.contextmanager
    def _update_lock(self, model: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open_lock(self.root / f"{model}.update.lock") as handle:
            # Held for a read and a write of a small file: waiting is fine.
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def update(self, model: str, change: Callable[[RolloutState], RolloutState]) -> RolloutState:
        """Read, change and write the model's state under its update lock, so a flag an
        operator sets and a step the controller records never overwrite each other."""
        with self._update_lock(model):
            state = self.load(model)
            if state is None:
                raise StateError(f"no rollout of model {model!r} has been recorded")
            new = change(state)
            self.save(new)
            return new

    # --- liveness ------------------------------------------------------------------------

    def alive(self, model: str) -> bool:
        """Whether a controller holds the model's lock (is alive) right now."""
        path = self.lock_path(model)
        if not path.exists():
            return False
        with open_lock(path, "r+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False

    @contextlib.contextmanager
    def controlling(self, model: str) -> Iterator[bool]:
        """Become the model's controller for the block: yields False (and holds nothing)
        when another live process already is one."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open_lock(self.lock_path(model), "r+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            try:
                yield True
            finally:
                handle.truncate(0)
                fcntl.flock(handle, fcntl.LOCK_UN)

    # --- history -------------------------------------------------------------------------

    def record(self, event: str, state: RolloutState, **fields: Any) -> None:
        """Append one event to the history (a single write of one line with O_APPEND, so
        concurrent writers never interleave within a line)."""
        self.root.mkdir(parents=True, exist_ok=True)
        entry = {
            "at": time.time(),
            "event": event,
            "rollout": state.id,
            "model": state.model,
            "version": state.version,
            "baseline": state.baseline,
            "step": state.step_label,
            **fields,
        }
        line = (json.dumps(entry, sort_keys=True, default=str) + "\n").encode()
        fd = os.open(self.history_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def history(self, model: str | None = None) -> list[dict[str, Any]]:
        """Every event, oldest first; a torn line (a crash mid-write) is skipped."""
        if not self.history_path.is_file():
            return []
        events = []
        for number, line in enumerate(self.history_path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                log.warning("%s line %d is torn; skipped", self.history_path.name, number)
                continue
            if isinstance(entry, dict) and (model is None or entry.get("model") == model):
                events.append(entry)
        return events
