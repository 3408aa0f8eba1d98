"""Registry backups: an online, consistent copy of the store, and its restore.

A backup folder holds snapshots and the artifacts they name:

    <out>/snapshots/<UTC time>/registry.db      the metadata, as of one moment
    <out>/snapshots/<UTC time>/manifest.json    what it holds: versions, sha256, aliases
    <out>/blobs/sha256/<2 hex>/<hex>            artifacts, content-addressed, shared

The metadata is copied with SQLite's online backup API in one step (every page under one
read transaction), so it is one moment of the store while uploads go on: a version row
exists only for an artifact already at its content address (the store's invariant), so
every artifact the copy names is there to copy after it. Artifacts are content-addressed,
so a snapshot copies only those no earlier snapshot in the folder has; each is hashed as
it is copied and a mismatch fails the backup (the store's own copy is damaged). A snapshot
is written under a temporary name and renamed whole: a crash leaves no half snapshot.

Restore goes through the registry's API, after checking the whole snapshot first: every
artifact there, of its recorded size and sha256, the database intact. A damaged backup is
refused with the list of what is wrong, and nothing is written. By default it goes into an
empty registry; with `missing_only` it puts back into a registry that still holds some of
it only what is missing (models, versions, aliases no one has set), and refuses, before
writing anything, a version the registry holds with other bytes than the snapshot's. The
registry verifies each upload's sha256 again as it stores it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.errors import ServemeshError
from servemesh.contract.private import private_dir

SNAPSHOTS = "snapshots"
BLOBS = "blobs"
MANIFEST = "manifest.json"
DB = "registry.db"
PARTIAL = ".partial"
_CHUNK = 1024 * 1024


class BackupFailed(ServemeshError):
    """A backup could not be taken (the store unreadable, an artifact damaged)."""


class BackupDamaged(ServemeshError):
    """A snapshot failed its check: nothing was restored."""


class RestoreRefused(ServemeshError):
    """The target registry is not empty."""


@dataclass(frozen=True)
class Entry:
    model: str
    version: str
    sha256: str
    size_bytes: int


@dataclass
class Manifest:
    snapshot: str
    taken_at: str  # UTC, ISO 8601
    taken_unix_ms: int
    schema_version: int
    versions: list[Entry]
    aliases: dict[str, dict[str, str]]
    new_blobs: int = 0
    copied_bytes: int = 0
    seconds: float = 0.0
    pruned: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return [f"{e.model}/{e.version}" for e in self.versions]


def blob_path(root: Path, sha256: str) -> Path:
    """An artifact's place under a backup folder, or a store's root (the same layout)."""
    return root / BLOBS / "sha256" / sha256[:2] / sha256


def _stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now * 1e6) % 1_000_000:06d}Z"


def _entries(db_file: Path) -> tuple[list[Entry], dict[str, dict[str, str]], int]:
    with sqlite3.connect(f"file:{db_file}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT model, version, sha256, size_bytes FROM versions "
            "ORDER BY created_unix_ms, rowid"
        ).fetchall()
        aliases: dict[str, dict[str, str]] = {}
        for model, alias, version in db.execute(
            "SELECT model, alias, version FROM aliases ORDER BY model, alias"
        ):
            aliases.setdefault(model, {})[alias] = version
        schema = int(db.execute("PRAGMA user_version").fetchone()[0])
    return [Entry(*row) for row in rows], aliases, schema


def _copy_verified(source: Path, target: Path, sha256: str, size: int) -> None:
    """Copy `source` to `target` by a temp file and a rename, checking size and sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    copied = 0
    fd, temp = tempfile.mkstemp(dir=target.parent, suffix=PARTIAL)
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as inp:
            while chunk := inp.read(_CHUNK):
                digest.update(chunk)
                copied += len(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if copied != size or digest.hexdigest() != sha256:
            raise BackupFailed(
                f"artifact {sha256} in the store is damaged: {copied} bytes, sha256 "
                f"{digest.hexdigest()} (its record: {size} bytes)"
            )
        os.replace(temp, target)
    finally:
        Path(temp).unlink(missing_ok=True)


def take_backup(store_root: Path, out: Path, *, keep: int | None = None) -> Manifest:
    """A snapshot of the store at `store_root` (running or not) in `out`; then only the
    newest `keep` snapshots are kept, and the artifacts none of them names removed."""
    began = time.monotonic()
    source_db = store_root / DB
    if not source_db.is_file():
        raise BackupFailed(f"no registry store at {store_root} ({DB} missing)")
    private_dir(out)
    private_dir(out / SNAPSHOTS)
    now = time.time()
    name = _stamp(now)
    partial = out / SNAPSHOTS / f"{name}{PARTIAL}"
    private_dir(partial)
    try:
        with sqlite3.connect(source_db) as source, sqlite3.connect(partial / DB) as copy:
            source.backup(copy)  # every page in one step: one moment of the store
        entries, aliases, schema = _entries(partial / DB)
        new = copied = 0
        for entry in entries:
            target = blob_path(out, entry.sha256)
            if target.is_file() and target.stat().st_size == entry.size_bytes:
                continue  # an earlier snapshot's: content-addressed, checked when copied
            source_blob = blob_path(store_root, entry.sha256)  # the store's layout too
            if not source_blob.is_file():
                raise BackupFailed(f"{entry.model}/{entry.version}: its artifact is missing")
            _copy_verified(source_blob, target, entry.sha256, entry.size_bytes)
            new += 1
            copied += entry.size_bytes
        manifest = Manifest(
            snapshot=name,
            taken_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            taken_unix_ms=int(now * 1000),
            schema_version=schema,
            versions=entries,
            aliases=aliases,
            new_blobs=new,
            copied_bytes=copied,
        )
        manifest.seconds = round(time.monotonic() - began, 3)
        atomic_write_text(partial / MANIFEST, json.dumps(asdict(manifest), indent=1) + "\n")
        os.replace(partial, out / SNAPSHOTS / name)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    if keep is not None:
        manifest.pruned = prune(out, keep)
    return manifest


def snapshots(out: Path) -> list[str]:
    """The complete snapshots in `out`, oldest first."""
    folder = out / SNAPSHOTS
    if not folder.is_dir():
        return []
    return sorted(
        p.name for p in folder.iterdir() if p.is_dir() and not p.name.endswith(PARTIAL)
        and (p / MANIFEST).is_file()
    )  # fmt: skip


def read_manifest(out: Path, snapshot: str) -> Manifest:
    raw: dict[str, Any] = json.loads((out / SNAPSHOTS / snapshot / MANIFEST).read_text())
    raw["versions"] = [Entry(**e) for e in raw["versions"]]
    return Manifest(**raw)


def prune(out: Path, keep: int) -> list[str]:
    """Keep the newest `keep` snapshots; remove the artifacts no kept one names."""
    if keep < 1:
        raise ValueError("keep at least one snapshot")
    names = snapshots(out)
    gone = names[:-keep]
    for name in gone:
        shutil.rmtree(out / SNAPSHOTS / name)
    named = {e.sha256 for name in names[-keep:] for e in read_manifest(out, name).versions}
    for blob in (out / BLOBS / "sha256").glob("*/*"):
        if blob.name not in named:
            blob.unlink()
    return gone


# --- the check before a restore --------------------------------------------------------


def check_snapshot(out: Path, snapshot: str) -> list[str]:
    """What is wrong with the snapshot (empty: it can be restored)."""
    folder = out / SNAPSHOTS / snapshot
    problems: list[str] = []
    if not (folder / DB).is_file():
        return [f"{snapshot}: {DB} missing"]
    try:
        with sqlite3.connect(f"file:{folder / DB}?mode=ro", uri=True) as db:
            verdict = db.execute("PRAGMA integrity_check").fetchone()[0]
        if verdict != "ok":
            problems.append(f"{snapshot}: the database fails its integrity check: {verdict}")
        entries, _aliases, _schema = _entries(folder / DB)
    except sqlite3.DatabaseError as exc:
        return [f"{snapshot}: the database does not open: {exc}"]
    for entry in entries:
        name = f"{entry.model}/{entry.version}"
        blob = blob_path(out, entry.sha256)
        if not blob.is_file():
            problems.append(f"{name}: artifact {entry.sha256} missing")
            continue
        digest = hashlib.sha256()
        size = 0
        with blob.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        if size != entry.size_bytes:
            problems.append(f"{name}: artifact is {size} bytes, its record {entry.size_bytes}")
        elif digest.hexdigest() != entry.sha256:
            problems.append(f"{name}: artifact sha256 {digest.hexdigest()} != {entry.sha256}")
    return problems


# --- restore ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Restored:
    snapshot: str
    models: int
    versions: int
    aliases: int
    seconds: float  # from the start of the restore to its last alias set
    # With missing_only: the versions the registry held already (same sha256), left alone,
    # and the aliases it points elsewhere now, kept as the registry has them.
    already_there: int = 0
    aliases_kept: list[str] = field(default_factory=list)


async def _held(stub: Any, registry_pb2: Any) -> tuple[dict[str, Any], dict[tuple[str, str], str]]:
    """The registry's models now (by name) and each version's sha256."""
    models = {
        m.name: m
        for m in (await stub.ListModels(registry_pb2.ListModelsRequest(), timeout=10)).models
    }
    versions: dict[tuple[str, str], str] = {}
    for name in models:
        listed = await stub.ListVersions(registry_pb2.ListVersionsRequest(model=name), timeout=10)
        for v in listed.versions:
            versions[(name, v.version)] = v.sha256
    return models, versions


async def restore(
    out: Path,
    snapshot: str | None,
    channel: Any,
    credential: Any,
    *,
    max_artifact_bytes: int,
    progress: Callable[[str], None] = lambda _: None,
    missing_only: bool = False,
) -> Restored:
    """Every model, version and alias of the snapshot (the newest when None) into the
    empty registry behind `channel` (grpc.aio), through its API; with `missing_only`, what
    of it the registry lacks (see the module's docstring)."""
    from servemesh.registry.client import push_version, set_alias
    from servemesh.registry.store import RegistryStore
    from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

    began = time.monotonic()
    names = snapshots(out)
    if not names:
        raise BackupDamaged(f"no snapshot in {out}")
    chosen = snapshot or names[-1]
    if chosen not in names:
        raise BackupDamaged(f"no snapshot {chosen!r} in {out}; there are {names}")
    problems = check_snapshot(out, chosen)
    if problems:
        listed = "\n  ".join(problems)
        raise BackupDamaged(f"snapshot {chosen} is damaged; nothing restored:\n  {listed}")
    stub = registry_pb2_grpc.RegistryStub(channel)
    held_models, held_versions = await _held(stub, registry_pb2)
    if held_models and not missing_only:
        raise RestoreRefused(
            f"the registry is not empty (models {sorted(held_models)}): restore goes into an "
            "empty one"
        )
    with tempfile.TemporaryDirectory(prefix="servemesh-restore-") as scratch:
        # The store's own reader, on a copy (an older snapshot's schema migrated there).
        root = Path(scratch)
        shutil.copyfile(out / SNAPSHOTS / chosen / DB, root / DB)
        copy = RegistryStore(root, max_artifact_bytes)
        try:
            models = copy.list_models()
            versions = {m.name: copy.list_versions(m.name) for m in models}
        finally:
            copy.close()
    clashes = [
        f"{r.model}/{r.version}: the registry holds sha256 {held_versions[(r.model, r.version)]}, "
        f"the snapshot {r.sha256}"
        for model in models
        for r in versions[model.name]
        if held_versions.get((r.model, r.version), r.sha256) != r.sha256
    ]
    if clashes:
        listed = "\n  ".join(clashes)
        raise RestoreRefused(f"versions differ from the snapshot's; nothing restored:\n  {listed}")
    count = aliases = there = 0
    kept: list[str] = []
    for model in models:
        if model.name not in held_models:
            await stub.CreateModel(
                registry_pb2.CreateModelRequest(name=model.name, description=model.description),
                timeout=10,
                metadata=credential,
            )
        for record in versions[model.name]:
            if (record.model, record.version) in held_versions:
                there += 1
                continue
            data = blob_path(out, record.sha256).read_bytes()
            await push_version(
                channel,
                model=record.model,
                version=record.version,
                data=data,
                inputs=record.inputs,
                outputs=record.outputs,
                labels=record.labels,
                lineage=record.lineage,
                metrics=record.metrics,
                format=record.format,
                credential=credential,
            )
            count += 1
            progress(f"{record.model}/{record.version}")
        now_aliases = dict(held_models[model.name].aliases) if model.name in held_models else {}
        for alias, version in model.aliases.items():
            if alias in now_aliases:
                if now_aliases[alias] != version:
                    # Set since the snapshot: the registry's newer choice stands.
                    kept.append(f"{model.name}@{alias} -> {now_aliases[alias]}")
                continue
            await set_alias(channel, model.name, alias, version, credential=credential)
            aliases += 1
    return Restored(
        snapshot=chosen,
        models=len(models),
        versions=count,
        aliases=aliases,
        seconds=round(time.monotonic() - began, 3),
        already_there=there,
        aliases_kept=kept,
    )


# --- on a schedule, in the registry process -------------------------------------------


class BackupMetrics:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.taken = Counter(
            "servemesh_registry_backups", "Scheduled backups, by outcome (ok, failed)",
            ["outcome"], registry=registry,
        )  # fmt: skip
        self.last_ok = Gauge(
            "servemesh_registry_backup_last_success_unixtime",
            "When the last scheduled backup succeeded", registry=registry,
        )  # fmt: skip


async def backup_every(
    interval_s: float,
    store_root: Path,
    out: Path,
    keep: int,
    metrics: BackupMetrics | None = None,
) -> None:
    """A backup every `interval_s` until cancelled; a failed one is logged and counted,
    and the next is tried on time."""
    import asyncio
    import logging

    log = logging.getLogger(__name__)
    while True:
        await asyncio.sleep(interval_s)
        try:
            manifest = await asyncio.to_thread(take_backup, store_root, out, keep=keep)
        except (OSError, sqlite3.Error, BackupFailed) as exc:
            log.error("registry backup failed", extra={"error": str(exc)[:500]})
            if metrics is not None:
                metrics.taken.labels("failed").inc()
            continue
        log.info(
            "registry backup taken",
            extra={
                "snapshot": manifest.snapshot,
                "versions": len(manifest.versions),
                "new_blobs": manifest.new_blobs,
                "pruned": len(manifest.pruned),
            },
        )
        if metrics is not None:
            metrics.taken.labels("ok").inc()
            metrics.last_ok.set(manifest.taken_unix_ms / 1000)
