"""The feature store's data lost and restored from its backup, as a drill: the store backed
up under load (as `servemesh backup` backs up its features part), one more row written
after the backup, then every key of the store deleted while Redis keeps running (a flush
by mistake, a script with the wrong prefix), and the backup restored.

| fault | restore |
| --- | --- |
| empty_feature_store (every key under the store's prefix deleted) | restore_feature_store |

While the data is gone the gateways answer NOT_FOUND naming the entity (a missing entity is
the caller's clear error, not a fallback). `restore_feature_store` measures the RTO: from
the start of the restore to every backed-up key back; `feature_store_matches_backup` checks
every key of the backup is there with the value it had and names what the restore could
not bring back, the row written after the backup (the RPO, with the backup's age at the
loss). Both are marked on the timeline and written to `feature-restore.md`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servemesh.chaos.drill import current
from servemesh.features.backup import Manifest, back_up, restore, verified_records
from servemesh.spec.store_clients import store_writer_sync

__all__ = [
    "backup_feature_store",
    "write_after_the_backup",
    "empty_feature_store",
    "restore_feature_store",
    "feature_store_matches_backup",
    "feature_store_holds_backup",
]

BACKUP_DIR = "feature-backup"
# The row written after the backup: the one key the restore cannot bring back.
LATE_SUFFIX = "drill-late-row"


@dataclass
class _State:
    manifest: Manifest | None = None
    backup_wall: float = 0.0
    late_key: str = ""
    lost_wall: float = 0.0
    keys_lost: int = 0
    rto_s: float | None = None
    restored_keys: int = 0
    compared: dict[str, Any] = field(default_factory=dict)


def _state() -> _State:
    return current().handoff(_State)


def _client() -> Any:
    return store_writer_sync(current().spec)


def _prefix() -> str:
    return current().spec.feature_store.key_prefix


def backup_feature_store() -> dict[str, Any]:
    """Every key of the store into the drill's folder, while the load runs."""
    drill = current()
    client = _client()
    try:
        manifest = back_up(client, _prefix(), drill.out_dir / BACKUP_DIR)
    finally:
        client.close()
    state = _state()
    state.manifest, state.backup_wall = manifest, time.time()
    drill.timeline.mark(f"feature store backup: {manifest.keys:,} keys in {manifest.seconds:g} s")
    return {"keys": manifest.keys, "bytes": manifest.bytes, "seconds": manifest.seconds}


def write_after_the_backup() -> dict[str, Any]:
    """One key written after the backup: what a restore from it cannot bring back."""
    state = _state()
    state.late_key = f"{_prefix()}:{LATE_SUFFIX}"
    client = _client()
    try:
        client.set(state.late_key, str(time.time()))
    finally:
        client.close()
    current().timeline.mark(f"wrote {state.late_key} after the backup")
    return {"key": state.late_key}


def _keys(client: Any) -> list[bytes]:
    return list(client.scan_iter(match=f"{_prefix()}:*", count=1000))


def empty_feature_store() -> dict[str, Any]:
    """Delete every key under the store's prefix; Redis itself keeps running."""
    drill = current()
    client = _client()
    try:
        keys = _keys(client)
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])
    finally:
        client.close()
    state = _state()
    state.lost_wall, state.keys_lost = time.time(), len(keys)
    drill.timeline.open_window("features:lost", "feature data lost")
    return {"deleted": len(keys)}


def restore_feature_store() -> dict[str, Any]:
    """Put the backup's keys back; the RTO is from here to every one of them back. Safe to
    run twice (a restore writes the same keys again)."""
    drill = current()
    state = _state()
    if state.manifest is None:
        drill.timeline.close_window("features:lost")
        return {"restored": None, "why": "no backup was taken"}
    began = time.monotonic()
    client = _client()
    try:
        done = restore(client, drill.out_dir / BACKUP_DIR, prefix=_prefix())
    finally:
        client.close()
    if state.rto_s is None:
        state.rto_s = round(time.monotonic() - began, 3)
        state.restored_keys = done.keys
        drill.timeline.mark(
            f"RTO: {done.keys:,} keys back {state.rto_s:g} s after the restore began"
        )
    drill.timeline.close_window("features:lost")
    return {"rto_s": state.rto_s, "keys": done.keys}


def _compare() -> dict[str, Any]:
    """Every key of the backup, with its value as Redis serializes it; the late row."""
    drill = current()
    state = _state()
    assert state.manifest is not None
    records = verified_records(drill.out_dir / BACKUP_DIR, state.manifest)
    client = _client()
    try:
        pipe = client.pipeline(transaction=False)
        for key, _ttl, _payload in records:
            pipe.dump(key)
        now = pipe.execute()
        late_there = bool(state.late_key) and bool(client.exists(state.late_key))
        missing = sum(1 for got in now if got is None)
        # A DUMP is the value's bytes in the server's encoding: equal bytes, the same value.
        # A big hash or set may serialize in another order after a RESTORE, so where the
        # bytes differ the values themselves are compared.
        changed = [
            key.decode(errors="replace")
            for got, (key, _t, payload) in zip(now, records, strict=True)
            if got is not None and got != payload and not _same_value(client, key, payload)
        ]
    finally:
        client.close()
    differ = len(changed)
    return {
        "ok": missing == 0 and differ == 0,
        "backed_up": len(records),
        "missing": missing,
        "different": differ,
        "different_keys": changed[:5],
        "lost_after_backup": [] if late_there or not state.late_key else [state.late_key],
    }


def _read(client: Any, key: bytes | str) -> Any:
    kind = client.type(key)
    if kind == b"hash":
        return client.hgetall(key)
    if kind == b"set":
        return client.smembers(key)
    if kind == b"zset":
        return client.zrange(key, 0, -1, withscores=True)
    if kind == b"list":
        return client.lrange(key, 0, -1)
    return client.get(key)


def _same_value(client: Any, key: bytes, payload: bytes) -> bool:
    """Whether `key` holds the value `payload` (a DUMP) serializes, read back through a
    scratch key of the store's prefix."""
    scratch = f"{_prefix()}:drill-compare-scratch"
    client.restore(scratch, 0, payload, replace=True)
    try:
        return bool(
            client.type(scratch) == client.type(key)
            and _read(client, scratch) == _read(client, key)
        )
    finally:
        client.delete(scratch)


def feature_store_matches_backup() -> dict[str, Any]:
    """What came back, and what could not (RPO); marked and written to feature-restore.md."""
    drill = current()
    state = _state()
    found = _compare()
    rpo_s = round(state.lost_wall - state.backup_wall, 1) if state.lost_wall else None
    found["rpo_s"] = rpo_s
    found["rto_s"] = state.rto_s
    lost = found["lost_after_backup"]
    drill.timeline.mark(
        f"RPO: the backup was {rpo_s} s old at the loss; lost: {', '.join(lost) or '-'}"
    )
    state.compared = found
    _write_report(drill.out_dir, state, found)
    return found


def feature_store_holds_backup() -> bool:
    """The steady-state check: every key of the drill's backup is in the store, with its
    value (true before a backup exists: nothing to hold yet)."""
    if _state().manifest is None:
        return True
    return bool(_compare()["ok"])


def _write_report(out_dir: Path, state: _State, found: dict[str, Any]) -> None:
    manifest = state.manifest
    assert manifest is not None
    lines = [
        "# Feature store restore",
        "",
        f"- backup: {manifest.keys:,} keys ({manifest.bytes:,} bytes) in {manifest.seconds:g} s",
        f"- lost: {state.keys_lost:,} keys deleted",
        f"- RTO: {state.rto_s} s from the start of the restore to every key back "
        f"({state.restored_keys:,} keys)",
        f"- RPO: the backup was {found['rpo_s']} s old when the data was lost; not brought "
        f"back: {', '.join(found['lost_after_backup']) or 'nothing'}",
        f"- every backed-up key back with its value: {found['ok']} "
        f"({found['missing']} missing, {found['different']} different)",
    ]
    (out_dir / "feature-restore.md").write_text("\n".join(lines) + "\n")
