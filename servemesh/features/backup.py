"""The online feature store backed up and restored while the mesh serves: every key of the
store's prefix as Redis serializes it (DUMP, with its remaining time to live), and put
back with RESTORE ... REPLACE.

A backup is a folder of two files: `feature-store.jsonl` (one key a line: the key, its TTL
in ms, or 0 for none, and DUMP's payload, both base64) and `manifest.json` (when, how many
keys and bytes, the file's sha256, how long it took). A restore reads and checks the whole
file against the manifest's sha256 and counts before it writes anything, so a backup that
does not verify changes nothing; Redis checks each payload's own checksum and version
again at RESTORE. Keys written after the backup and absent from it stay as they are (a
restore puts back what was lost; it does not roll the store back).

The walk is SCAN: each key is read whole, but keys are not read at one instant, so a
feature load that runs during a backup may be in it in part. A view's versions are keys
like any other: a load half in the backup is a version the view never switched to, and
the view's pointer (its own key) names the version it served at that moment. Take
backups between loads, or re-run the load after a restore (loads are idempotent).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.errors import ServemeshError

DATA_FILE = "feature-store.jsonl"
MANIFEST_FILE = "manifest.json"
# Keys read or written per round trip.
BATCH = 500


class BackupError(ServemeshError, ValueError):
    """The backup cannot be used as it is; nothing was restored."""


@dataclass(frozen=True)
class Manifest:
    taken_at: str  # UTC, ISO 8601
    prefix: str
    keys: int
    bytes: int
    sha256: str
    seconds: float

    def age_s(self, now: datetime | None = None) -> float:
        """How old the backup is: what a restore from it loses at most (its RPO then)."""
        taken = datetime.fromisoformat(self.taken_at)
        return ((now or datetime.now(UTC)) - taken).total_seconds()


@dataclass(frozen=True)
class Restored:
    keys: int
    seconds: float
    age_s: float


def back_up(client: redis.Redis, prefix: str, out_dir: Path) -> Manifest:
    """Write every key under `prefix:` to `out_dir` (created, owner-only), then its
    manifest; an existing backup there is replaced only once the new one is whole."""
    began = time.perf_counter()
    taken_at = datetime.now(UTC).isoformat(timespec="seconds")
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(out_dir, 0o700)
    digest = hashlib.sha256()
    keys = 0
    size = 0
    partial = out_dir / f".{DATA_FILE}.partial"
    with open(partial, "wb") as sink:
        os.chmod(partial, 0o600)
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}:*", count=BATCH):
            batch.append(key)
            if len(batch) >= BATCH:
                keys, size = _write_batch(client, batch, sink, digest, keys, size)
                batch = []
        if batch:
            keys, size = _write_batch(client, batch, sink, digest, keys, size)
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(partial, out_dir / DATA_FILE)
    manifest = Manifest(
        taken_at=taken_at,
        prefix=prefix,
        keys=keys,
        bytes=size,
        sha256=digest.hexdigest(),
        seconds=round(time.perf_counter() - began, 3),
    )
    atomic_write_text(out_dir / MANIFEST_FILE, json.dumps(asdict(manifest), indent=1) + "\n")
    os.chmod(out_dir / MANIFEST_FILE, 0o600)
    return manifest


def _write_batch(
    client: redis.Redis,
    batch: list[bytes],
    sink: Any,
    digest: Any,
    keys: int,
    size: int,
) -> tuple[int, int]:
    pipe = client.pipeline(transaction=False)
    for key in batch:
        pipe.pttl(key)
        pipe.dump(key)
    answers = pipe.execute()
    for key, ttl, payload in zip(batch, answers[0::2], answers[1::2], strict=True):
        if payload is None:  # gone (expired or deleted) between SCAN and DUMP
            continue
        line = (
            json.dumps(
                {
                    "key": base64.b64encode(key).decode(),
                    "ttl_ms": max(int(ttl), 0),  # -1: no expiry
                    "dump": base64.b64encode(payload).decode(),
                }
            ).encode()
            + b"\n"
        )
        sink.write(line)
        digest.update(line)
        keys += 1
        size += len(line)
    return keys, size


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST_FILE
    try:
        return Manifest(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise BackupError(f"{folder}: no {MANIFEST_FILE}: not a feature store backup") from None
    except (ValueError, TypeError) as exc:
        raise BackupError(f"{path}: not a manifest this version reads ({exc})") from None


def verified_records(folder: Path, manifest: Manifest) -> list[tuple[bytes, int, bytes]]:
    """Every (key, ttl_ms, payload) of the backup, once the file matched its manifest:
    its sha256, its key count, and every key under the manifest's prefix."""
    path = folder / DATA_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BackupError(f"{folder}: no {DATA_FILE}") from None
    if hashlib.sha256(data).hexdigest() != manifest.sha256:
        raise BackupError(f"{path}: its sha256 is not the manifest's: changed or damaged")
    records = []
    for number, line in enumerate(data.splitlines(), start=1):
        try:
            entry = json.loads(line)
            record = (
                base64.b64decode(entry["key"], validate=True),
                int(entry["ttl_ms"]),
                base64.b64decode(entry["dump"], validate=True),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise BackupError(f"{path}:{number}: not a backed-up key ({exc})") from None
        if not record[0].startswith(manifest.prefix.encode() + b":"):
            raise BackupError(f"{path}:{number}: a key outside the prefix {manifest.prefix!r}")
        records.append(record)
    if len(records) != manifest.keys:
        raise BackupError(f"{path}: {len(records)} keys, the manifest says {manifest.keys}")
    return records


def restore(client: redis.Redis, folder: Path, *, prefix: str) -> Restored:
    """Put every key of the backup in `folder` back (replacing what is there now), each
    with the time to live it had left; BackupError, with nothing written, when the backup
    does not verify or is another store's (another prefix)."""
    began = time.perf_counter()
    manifest = read_manifest(folder)
    if manifest.prefix != prefix:
        raise BackupError(
            f"{folder}: a backup of the keys under {manifest.prefix!r}; this store's are "
            f"under {prefix!r}"
        )
    records = verified_records(folder, manifest)
    for start in range(0, len(records), BATCH):
        pipe = client.pipeline(transaction=False)
        for key, ttl_ms, payload in records[start : start + BATCH]:
            pipe.restore(key, ttl_ms, payload, replace=True)
        pipe.execute()
    return Restored(
        keys=len(records),
        seconds=round(time.perf_counter() - began, 3),
        age_s=round(manifest.age_s(), 1),
    )
