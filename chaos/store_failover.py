"""A replicated feature store's primary lost while a feature load runs, as a drill. The
killed server comes back as a replica of the new primary (the Sentinels make it one).

| fault | restore |
| --- | --- |
| kill_store_primary (SIGKILL of the server named primary) | restart_lost_primary |

`start_feature_load` writes a feature file of its own (every demo entity and many more, so
the load takes seconds) and starts `servemesh features load` on it, a process of its own
as an operator's would be. The primary is killed while it runs; `await_new_primary` marks
how long the Sentinels took to name another; `finish_feature_load` waits for the load,
runs it again while it fails (each failure's message kept: it must say why), and then
counts what the view serves: every row of the file, in the version the last load made
current. A load that exited 0 was acknowledged, and a replicated store acknowledges a
load only once a replica holds it (services/feature/store.py), so none of its rows may be
missing after the failover. The numbers go on the timeline and into `store-failover.md`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import redis

from servemesh.chaos.drill import current
from servemesh.chaos.errors import DrillError
from servemesh.contract.demo import DEMO_FEATURES
from servemesh.spec import SENTINEL_MASTER_NAME

__all__ = [
    "start_feature_load",
    "kill_store_primary",
    "await_new_primary",
    "finish_feature_load",
    "restart_lost_primary",
]

LOAD_FILE = "feature-load.parquet"
# Between a failed load and the next try.
RETRY_EVERY_S = 1.0
VIEW = "user"


@dataclass
class _State:
    rows: int = 0
    load: subprocess.Popen[str] | None = None
    load_started: float = 0.0
    killed: str = ""
    killed_at: float = 0.0
    old_primary: tuple[str, int] | None = None
    promoted_s: float | None = None
    tries: list[dict[str, Any]] = field(default_factory=list)


def _state() -> _State:
    return current().handoff(_State)


def primary_address() -> tuple[str, int] | None:
    """The primary the first Sentinel that answers names; None when none answers."""
    spec = current().spec
    password = spec.redis_password()
    for host, port in spec.sentinels:
        try:
            with redis.Redis(host=host, port=port, password=password, socket_timeout=1.0) as s:
                found = s.sentinel_get_master_addr_by_name(SENTINEL_MASTER_NAME)
        except (redis.ConnectionError, redis.TimeoutError):
            continue  # a Sentinel that is down
        if found:
            host_found = found[0].decode() if isinstance(found[0], bytes) else str(found[0])
            return host_found, int(found[1])
    return None


def _server_named(address: tuple[str, int]) -> str:
    """The mesh's process serving the store at `address`."""
    spec = current().spec
    if address == (spec.host, spec.embedded_redis_port):
        return "redis"
    for zone in spec.zones:
        if spec.store_replica(zone) == address:
            return f"redis-replica-{zone}"
    raise DrillError(f"no server of the mesh's store listens on {address[0]}:{address[1]}")


def _load_command(path: Path) -> list[str]:
    state_dir = str(current().running_mesh.state_dir)
    return [sys.executable, "-m", "servemesh", "features", "load", str(path),
            "--view", VIEW, "--key", "id", "--state-dir", state_dir]  # fmt: skip


def start_feature_load(rows: int = 150_000) -> dict[str, Any]:
    """Write a file of `rows` entities (the demo's first) and start loading it."""
    drill = current()
    if rows < drill.spec.demo.entities:
        raise DrillError(f"rows: {rows} would drop demo entities the load calls for")
    values = np.random.default_rng(11).normal(size=(rows, len(DEMO_FEATURES)))
    columns: dict[str, Any] = {"id": [f"user-{i}" for i in range(rows)]}
    for j, name in enumerate(DEMO_FEATURES):
        columns[name] = values[:, j].astype(np.float32)
    path = drill.out_dir / LOAD_FILE
    pq.write_table(pa.table(columns), path)
    state = _state()
    state.rows = rows
    state.load_started = time.monotonic()
    state.load = subprocess.Popen(
        _load_command(path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    drill.timeline.mark(f"feature load of {rows:,} rows started")
    return {"rows": rows, "pid": state.load.pid}


def kill_store_primary() -> dict[str, Any]:
    """SIGKILL the server the Sentinels name primary (held down until the restore)."""
    drill = current()
    address = primary_address()
    if address is None:
        raise DrillError("no Sentinel names a primary: is the store replicated?")
    name = _server_named(address)
    pid = drill.kill(name)
    state = _state()
    state.killed, state.killed_at, state.old_primary = name, time.monotonic(), address
    load_running = state.load is not None and state.load.poll() is None
    drill.timeline.open_window("store:primary-lost", f"store primary {name} lost")
    return {"killed": name, "pid": pid, "load_running": load_running}


def await_new_primary(timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until a Sentinel names another primary; how long after the kill."""
    drill = current()
    state = _state()
    deadline = time.monotonic() + timeout_s
    while (found := primary_address()) in (None, state.old_primary):
        if time.monotonic() > deadline:
            raise DrillError(f"no new primary named within {timeout_s:g} s of the kill")
        time.sleep(0.1)
    state.promoted_s = round(time.monotonic() - state.killed_at, 2)
    assert found is not None
    drill.timeline.mark(f"new primary {_server_named(found)} {state.promoted_s:g} s after the kill")
    return {"primary": _server_named(found), "after_s": state.promoted_s}


def _finished(process: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    return {"exit": process.returncode, "said": (err.strip() or out.strip())[-400:]}


def finish_feature_load(timeout_s: float = 180.0) -> dict[str, Any]:
    """Wait for the load; run it again while it fails; then count what the view serves."""
    drill = current()
    state = _state()
    if state.load is None:
        raise DrillError("no feature load was started")
    deadline = time.monotonic() + timeout_s
    state.tries.append(_finished(state.load, max(1.0, deadline - time.monotonic())))
    while state.tries[-1]["exit"] != 0:
        if time.monotonic() > deadline:
            raise DrillError(f"the feature load never succeeded: {state.tries}")
        time.sleep(RETRY_EVERY_S)  # as an operator would, not in a tight loop
        again = subprocess.Popen(
            _load_command(drill.out_dir / LOAD_FILE),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        state.tries.append(_finished(again, max(1.0, deadline - time.monotonic())))
    loaded_s = round(time.monotonic() - state.load_started, 2)
    served = _rows_served()
    drill.timeline.mark(
        f"feature load done after {len(state.tries)} tries, {loaded_s:g} s after it began: "
        f"{served:,} of {state.rows:,} rows served"
    )
    found = {
        "rows_in_file": state.rows,
        "rows_served": served,
        "lost": state.rows - served,
        "tries": state.tries,
        "promoted_s": state.promoted_s,
        "loaded_s": loaded_s,
    }
    _write_report(drill.out_dir, state, found)
    return found


def _rows_served() -> int:
    """Rows in the view's current version, counted on the primary."""
    spec = current().spec
    address = primary_address()
    if address is None:
        raise DrillError("no Sentinel names a primary to count the rows on")
    prefix = spec.feature_store.key_prefix
    with redis.Redis(host=address[0], port=address[1], password=spec.redis_password()) as client:
        version = client.get(f"{prefix}:{VIEW}:current")
        if version is None:
            return 0
        pattern = f"{prefix}:{VIEW}@{int(version)}:*"
        return sum(1 for _ in client.scan_iter(match=pattern, count=10_000))


def restart_lost_primary(timeout_s: float = 60.0) -> dict[str, Any]:
    """Start the killed server again (the Sentinels make it a replica of the new primary).
    Safe to run twice."""
    drill = current()
    state = _state()
    if state.load is not None and state.load.poll() is None:
        state.load.kill()  # a rollback while the load still ran: it has no one to report to
        state.load.communicate()
    pid = None
    if state.killed and not drill.running_mesh.is_running(state.killed):
        pid = drill.running_mesh.restart(state.killed, timeout_s=timeout_s)
    drill.timeline.close_window("store:primary-lost")
    return {"restarted": state.killed or None, "pid": pid}


def _tries_text(tries: list[dict[str, Any]]) -> list[str]:
    """One line per run of tries that ended alike."""
    lines: list[str] = []
    first = 1
    for i, attempt in enumerate(tries, 1):
        if i < len(tries) and tries[i] == attempt:
            continue
        which = f"try {first}" if first == i else f"tries {first}-{i}"
        lines.append(f"  - {which}: exit {attempt['exit']}: {attempt['said'] or '-'}")
        first = i + 1
    return lines


def _write_report(out_dir: Path, state: _State, found: dict[str, Any]) -> None:
    lines = [
        "# Feature store primary lost during a load",
        "",
        f"- killed: {state.killed} (the primary) while a load of {state.rows:,} rows ran",
        f"- new primary named {state.promoted_s} s after the kill",
        f"- the load: {len(state.tries)} tries, done {found['loaded_s']} s after it began",
        *(
            f"  - try {i}: exit {t['exit']}: {t['said'] or '-'}"
            for i, t in enumerate(state.tries, 1)
        ),
        f"- rows served after it: {found['rows_served']:,} of {found['rows_in_file']:,} "
        f"(lost: {found['lost']:,})",
    ]
    (out_dir / "store-failover.md").write_text("\n".join(lines) + "\n")
