"""Crashes of model servers, what was in flight in each, and the versions quarantined.

The launcher, on a model server's unexpected exit (a signal or a non-zero status), reads
the instance's in-flight journal (servemesh.contract.inflight) and calls `Quarantine.record_crash`:
the crash goes to `<state_dir>/crashes.jsonl` (one JSON line each, private to the mesh's
user), and the (model, version) pairs that were in flight in `sandbox.quarantine.crashes`
crashes within `within` come back as due. `quarantine_version` then moves the version's
traffic, through the route manager (recorded in `routes history`), to the model's last
good version, and lists it in `<state_dir>/quarantine.json`. `servemesh models release`
takes it off that list (`release`); it moves no traffic back.

The decision (`due_versions`, `last_good_version`, `quarantined_weights`) is pure: records
and a clock reading in, keys out, so unit tests drive it with a clock of their own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servemesh.contract.atomic import atomic_write_text
from servemesh.proxy.apply import ApplyResult, RouteManager
from servemesh.spec import QuarantineSpec
from servemesh.spec.durations import duration_seconds
from servemesh.state.paths import ApplyError

log = logging.getLogger(__name__)

CRASHES_FILE = "crashes.jsonl"
QUARANTINE_FILE = "quarantine.json"
# Who the route change is recorded as (`routes history`).
QUARANTINE_ACTOR = "quarantine"

Key = tuple[str, str]  # (model, version)
Clock = Callable[[], float]  # seconds since the epoch (records carry wall time)


def crashes_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / CRASHES_FILE


def quarantine_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / QUARANTINE_FILE


def natural_key(version: str) -> tuple[object, ...]:
    """Sort key under which v10 comes after v9 (as the model server orders versions)."""
    parts = re.split(r"(\d+)", version)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def exit_text(status: int) -> str:
    """`SIGSEGV` for a negative status (the signal), `exit 3` for a positive one."""
    if status < 0:
        try:
            import signal

            return signal.Signals(-status).name
        except ValueError:
            return f"signal {-status}"
    return f"exit {status}"


# --- the crash records ----------------------------------------------------------------------


def crash_record(
    when: float, instance: str, pool: str, status: int, inflight: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One crash as `crashes.jsonl` keeps it: the in-flight calls flattened, each with its
    model and version (a server runs a thread per version, each with its own batch)."""
    calls = [
        {
            "model": str(batch.get("model", "")),
            "version": str(batch.get("version", "")),
            "request_id": str(call.get("request_id", "")),
            "caller": str(call.get("caller", "")),
            "sha256": str(call.get("sha256", "")),
        }
        for batch in inflight
        for call in batch.get("calls", ())
        if isinstance(call, dict)
    ]
    record: dict[str, Any] = {
        "time": when,
        "instance": instance,
        "pool": pool,
        "exit": status,
        "exit_text": exit_text(status),
        "inflight": calls,
    }
    left_out = sum(int(batch.get("more", 0) or 0) for batch in inflight)
    if left_out:
        record["inflight_left_out"] = left_out
    return record


def append_crash(state_dir: str | Path, record: Mapping[str, Any]) -> None:
    """Append one record (0600: the launcher runs under umask 077, the file stays private)."""
    path = crashes_path(state_dir)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a") as handle:
        handle.write(json.dumps(record, sort_keys=True) + "\n")


def read_crashes(state_dir: str | Path) -> list[dict[str, Any]]:
    """Every crash record, oldest first; a torn or foreign line is skipped."""
    path = crashes_path(state_dir)
    if not path.is_file():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("inflight"), list):
            found.append(record)
    return found


def keys_in(record: Mapping[str, Any]) -> set[Key]:
    """The (model, version) pairs a crash had in flight."""
    return {
        (str(call.get("model")), str(call.get("version")))
        for call in record.get("inflight", ())
        if isinstance(call, dict) and call.get("model") and call.get("version")
    }


def crashes_of(
    records: Iterable[Mapping[str, Any]], model: str, version: str | None = None
) -> list[Mapping[str, Any]]:
    """The records with a call of `model` (of `version`, when given) in flight."""
    return [
        r
        for r in records
        if any(m == model and (version is None or v == version) for m, v in keys_in(r))
    ]


# --- the decision (pure) --------------------------------------------------------------------


def due_versions(
    records: Iterable[Mapping[str, Any]],
    policy: QuarantineSpec,
    now: float,
    quarantined: Iterable[Key] = (),
    released: Mapping[Key, float] | None = None,
) -> list[Key]:
    """The (model, version) pairs in flight in at least `policy.crashes` crashes within
    `policy.within` before `now`, not quarantined already. Crashes before a version's
    release do not count against it again (the operator released it knowing them)."""
    if not policy.enabled:
        return []
    since = now - duration_seconds(policy.within)
    released = released or {}
    skip = set(quarantined)
    counts: dict[Key, int] = {}
    for record in records:
        when = float(record.get("time", 0.0))
        if when < since or when > now:
            continue
        for key in keys_in(record):
            if key in skip or when <= released.get(key, float("-inf")):
                continue
            counts[key] = counts.get(key, 0) + 1
    return sorted(k for k, n in counts.items() if n >= policy.crashes)


def last_good_version(
    traffic: Mapping[str, int], version: str, quarantined: Iterable[Key], model: str
) -> str | None:
    """Where a quarantined version's share goes: the highest version with a non-zero
    weight that is neither it nor quarantined; None when there is none."""
    bad = {v for m, v in quarantined if m == model} | {version}
    good = [v for v, weight in traffic.items() if weight > 0 and v not in bad]
    return max(good, key=natural_key) if good else None


def quarantined_weights(traffic: Mapping[str, int], version: str, target: str) -> dict[str, int]:
    """The model's weights with `version`'s share moved to `target`."""
    weights = dict(traffic)
    share = weights.get(version, 0)
    weights[version] = 0
    weights[target] = weights.get(target, 0) + share
    return weights


# --- the state file ---------------------------------------------------------------------------


@dataclass
class QuarantineState:
    """`<state_dir>/quarantine.json`: the versions quarantined (when, why, where their
    traffic went) and when each released version was released."""

    quarantined: dict[Key, dict[str, Any]]
    released: dict[Key, float]

    @staticmethod
    def _key(text: str) -> Key:
        model, _, version = text.partition("/")
        return (model, version)

    @classmethod
    def read(cls, state_dir: str | Path) -> QuarantineState:
        path = quarantine_path(state_dir)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return cls({}, {})
        except ValueError:
            log.error("%s is not JSON; read as empty", path)
            return cls({}, {})
        return cls(
            {cls._key(k): dict(v) for k, v in dict(data.get("quarantined", {})).items()},
            {cls._key(k): float(v) for k, v in dict(data.get("released", {})).items()},
        )

    def write(self, state_dir: str | Path) -> None:
        data = {
            "quarantined": {
                f"{m}/{v}": entry for (m, v), entry in sorted(self.quarantined.items())
            },
            "released": {f"{m}/{v}": when for (m, v), when in sorted(self.released.items())},
        }
        atomic_write_text(quarantine_path(state_dir), json.dumps(data, indent=2) + "\n")


def release(
    state_dir: str | Path, model: str, version: str, clock: Clock = time.time
) -> dict[str, Any]:
    """Take a version off the quarantine list; its entry. KeyError when it is not on it.
    Traffic is not moved back: the operator does, with `routes set` or `apply`."""
    state = QuarantineState.read(state_dir)
    entry = state.quarantined.pop((model, version))
    state.released[(model, version)] = clock()
    state.write(state_dir)
    return entry


# --- the launcher's side ----------------------------------------------------------------------


class Quarantine:
    """Records crashes and quarantines what they keep naming (the launcher's one instance).

    `clock` gives seconds since the epoch; `move_traffic(model, version, reason)` moves a
    version's traffic away and returns where it went (None: it could not, already logged).
    """

    def __init__(
        self,
        state_dir: Path,
        policy: QuarantineSpec,
        move_traffic: Callable[[str, str, str], str | None],
        clock: Clock = time.time,
    ) -> None:
        self.state_dir = state_dir
        self.policy = policy
        self._move = move_traffic
        self._clock = clock

    def record_crash(
        self, instance: str, pool: str, status: int, inflight: Sequence[Mapping[str, Any]]
    ) -> list[Key]:
        """Append the crash; the versions due for quarantine now (not yet quarantined)."""
        now = self._clock()
        append_crash(self.state_dir, crash_record(now, instance, pool, status, inflight))
        state = QuarantineState.read(self.state_dir)
        return due_versions(
            read_crashes(self.state_dir), self.policy, now, state.quarantined, state.released
        )

    def quarantine(self, model: str, version: str) -> bool:
        """Move `version`'s traffic away and list it; whether it was listed."""
        reason = (
            f"quarantine: {model} {version} was in flight in {self.policy.crashes} model "
            f"server crashes within {self.policy.within}"
        )
        target = self._move(model, version, reason)
        if target is None:
            return False
        state = QuarantineState.read(self.state_dir)
        state.quarantined[(model, version)] = {
            "since": self._clock(),
            "reason": reason,
            "traffic_to": target,
        }
        state.released.pop((model, version), None)
        state.write(self.state_dir)
        return True


def move_traffic_away(
    manager: RouteManager, model: str, version: str, reason: str, state_dir: Path
) -> str | None:
    """Through the route manager (validated, confirmed by Envoy, in `routes history`):
    `version`'s weight to 0, its share to the model's last good version; that version's
    name. None, with an error logged, when there is no good version to take it (traffic
    is left as it is) or the change was refused."""
    live = manager.live_spec()
    entry = live.models.get(model)
    if entry is None or version not in entry.versions:
        log.error("quarantine: %s %s is not served; nothing to move", model, version)
        return None
    quarantined = QuarantineState.read(state_dir).quarantined
    if entry.traffic.get(version, 0) == 0:
        return "-"  # it carries no traffic: listed, nothing to move
    target = last_good_version(entry.traffic, version, quarantined, model)
    if target is None:
        log.error(
            "quarantine: %s %s keeps crashing its servers, but no other version of %s has "
            "traffic to take its share; traffic left as it is",
            model,
            version,
            model,
        )
        return None
    weights = quarantined_weights(entry.traffic, version, target)
    try:
        result: ApplyResult = manager.set_weights(
            model, weights, who=QUARANTINE_ACTOR, reason=reason
        )
    except ApplyError as exc:
        log.error("quarantine: could not move %s %s's traffic: %s", model, version, exc)
        return None
    log.warning(
        "quarantine: %s %s -> weight 0, its share to %s (%s)",
        model,
        version,
        target,
        result.entry_id,
    )
    return target
