"""What the scaler did and why, under `<state_dir>/scaling/`:

- `history.jsonl`: append-only, one JSON record per change of a pool (and per change that
  failed): when, which pool and zone, from and to, the reason, every signal it was decided
  on, and how it ended. `servemesh scale history` prints it.
- `status.json`: rewritten every round: per pool (model, gateway, feature), each zone's
  replicas (in rotation and standby), its last signals and what the last round decided (a
  hold says why). `servemesh scale status`
  prints it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.private import private_dir
from servemesh.scaling.decide import Decision

FOLDER = "scaling"


def history_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / FOLDER / "history.jsonl"


def status_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / FOLDER / "status.json"


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def record(
    state_dir: str | Path,
    decision: Decision,
    outcome: str,
    *,
    seconds: float | None = None,
    at: float | None = None,
) -> dict[str, Any]:
    """Append one decision that changed (or tried to change) a pool; the record written."""
    path = history_path(state_dir)
    private_dir(path.parent)
    entry = {
        "at": _when(time.time() if at is None else at),
        "pool": decision.pool,
        "zone": decision.zone,
        "from": decision.current,
        "to": decision.desired,
        "reason": decision.reason,
        "signal": decision.signal,
        "line": decision.line(),
        "floor": decision.floor,
        "signals": decision.signals.as_dict(),
        "outcome": outcome,
        "seconds": None if seconds is None else round(seconds, 2),
    }
    with path.open("a") as out:
        out.write(json.dumps(entry) + "\n")
    return entry


def read_history(state_dir: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The recorded decisions, oldest first (the last `limit`); a torn last line is skipped."""
    path = history_path(state_dir)
    if not path.is_file():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found[-limit:] if limit else found


def write_status(
    state_dir: str | Path,
    pools: Mapping[str, Mapping[str, Mapping[str, Any]]],
    held: str = "",
    *,
    host: Mapping[str, Any] | None = None,
    edges: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """`pools`: by kind (model, gateway, feature), each zone's last round; `held`: why the
    scaler did not decide at all ("" when it did); `host`: the host's load and headroom;
    `edges`: by zone, Predict at its edge against the objective."""
    path = status_path(state_dir)
    private_dir(path.parent)
    found = {
        "at": _when(time.time()),
        "held": held,
        "pools": pools,
        "host": dict(host or {}),
        "edges": dict(edges or {}),
    }
    atomic_write_text(path, json.dumps(found, indent=2))


def pool_status(found: Mapping[str, Any] | None, pool: str) -> dict[str, Any]:
    """One pool's zones from what `read_status` gave ({} when none)."""
    pools = (found or {}).get("pools", {})
    zones = pools.get(pool, {}) if isinstance(pools, dict) else {}
    return zones if isinstance(zones, dict) else {}


def read_status(state_dir: str | Path) -> dict[str, Any] | None:
    try:
        found = json.loads(status_path(state_dir).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
