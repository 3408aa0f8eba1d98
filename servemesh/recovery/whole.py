"""A whole mesh's backup (every part, one folder) and its restore, verified first.

The top manifest records each part's summary, the sha256 of the part's own manifest and
how long the part took; a restore checks those, then each part whole (the registry's
snapshot and artifacts, the feature store's file, every copied file), before it writes
anything. What a restore measures is printed and returned: how old the backup was (what
was written since is what it could not put back: the recovery point) and how long the
restore took, part by part (the recovery time).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.digests import file_sha256
from servemesh.proxy.apply import RouteManager
from servemesh.recovery.checksums import PART_MANIFEST, BackupDamaged
from servemesh.recovery.predictions import (
    back_up_predictions,
    restore_predictions,
    verify_predictions,
)
from servemesh.recovery.routes import back_up_routes, check_routes, restore_routes
from servemesh.state.running import RunningMesh

MANIFEST = "manifest.json"
FORMAT = 1
PARTS = ("registry", "features", "predictions", "routes")


@dataclass
class PartTaken:
    summary: dict[str, Any]
    manifest_sha256: str
    seconds: float


@dataclass
class WholeManifest:
    format: int
    taken_at: str  # UTC, ISO 8601
    seconds: float
    parts: dict[str, PartTaken] = field(default_factory=dict)
    # A part this mesh does not keep here (a prediction log in PostgreSQL), and why.
    not_backed_up: dict[str, str] = field(default_factory=dict)

    def age_s(self) -> float:
        return (datetime.now(UTC) - datetime.fromisoformat(self.taken_at)).total_seconds()


def _timed(work: Callable[[], tuple[dict[str, Any], str]]) -> PartTaken:
    began = time.perf_counter()
    summary, digest = work()
    return PartTaken(summary, digest, round(time.perf_counter() - began, 3))


def back_up_mesh(
    mesh: RunningMesh,
    out: Path,
    *,
    store_client: Callable[[], Any],
    progress: Callable[[str], None] = lambda _: None,
) -> WholeManifest:
    """Every store of the running `mesh` into `out` (a new or empty folder, made 0700)."""
    from servemesh.features.backup import back_up
    from servemesh.registry.backup import take_backup

    if out.exists() and any(out.iterdir()):
        raise BackupDamaged(f"{out}: not empty; a backup goes into a new folder")
    began = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    taken_at = datetime.now(UTC).isoformat(timespec="seconds")
    spec = mesh.spec
    manifest = WholeManifest(FORMAT, taken_at, 0.0)

    def registry() -> tuple[dict[str, Any], str]:
        snap = take_backup(spec.registry_store_dir, out / "registry")
        path = out / "registry" / "snapshots" / snap.snapshot / PART_MANIFEST
        summary = {"snapshot": snap.snapshot, "versions": len(snap.versions)}
        return summary, file_sha256(path)

    def features() -> tuple[dict[str, Any], str]:
        client = store_client()
        try:
            taken = back_up(client, spec.feature_store.key_prefix, out / "features")
        finally:
            client.close()
        return {"keys": taken.keys, "bytes": taken.bytes}, file_sha256(
            out / "features" / PART_MANIFEST
        )

    def predictions() -> tuple[dict[str, Any], str]:
        from servemesh.predlog.buffer import predictions_dir

        taken = back_up_predictions(predictions_dir(spec.state_dir), out / "predictions")
        return {"files": taken.files, "bytes": taken.bytes}, taken.manifest_sha256

    def routes() -> tuple[dict[str, Any], str]:
        taken = back_up_routes(RouteManager(mesh.paths), out / "routes")
        return {"models": taken.models, "files": taken.files}, taken.manifest_sha256

    work: dict[str, Callable[[], tuple[dict[str, Any], str]]] = {
        "registry": registry,
        "features": features,
        "predictions": predictions,
        "routes": routes,
    }
    if spec.prediction_log.dsn() is not None or not spec.prediction_log.enabled:
        del work["predictions"]
        manifest.not_backed_up["predictions"] = (
            "the prediction log is off"
            if not spec.prediction_log.enabled
            else "the prediction log is in PostgreSQL: back it up with PostgreSQL's own tools"
        )
    try:
        for name, part in work.items():
            manifest.parts[name] = _timed(part)
            progress(name)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # half a backup is no backup
        raise
    manifest.seconds = round(time.perf_counter() - began, 3)
    atomic_write_text(out / MANIFEST, json.dumps(asdict(manifest), indent=1) + "\n")
    os.chmod(out / MANIFEST, 0o600)
    return manifest


def read_whole_manifest(folder: Path) -> WholeManifest:
    try:
        raw = json.loads((folder / MANIFEST).read_text())
        raw["parts"] = {k: PartTaken(**v) for k, v in raw["parts"].items()}
        manifest = WholeManifest(**raw)
    except FileNotFoundError:
        raise BackupDamaged(
            f"{folder}: no {MANIFEST}: not a backup `servemesh backup` wrote"
        ) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise BackupDamaged(f"{folder / MANIFEST}: unreadable ({exc})") from None
    if manifest.format != FORMAT:
        raise BackupDamaged(f"{folder}: backup format {manifest.format}; this build reads {FORMAT}")
    return manifest


@dataclass
class PartRestored:
    seconds: float
    detail: dict[str, Any]


@dataclass
class WholeRestored:
    backup_age_s: float  # the recovery point: what was written after it is not in it
    seconds: float  # the recovery time, every part together
    parts: dict[str, PartRestored] = field(default_factory=dict)


def _check_part_manifest(folder: Path, name: str, taken: PartTaken) -> None:
    path = (
        folder / "registry" / "snapshots" / str(taken.summary["snapshot"]) / PART_MANIFEST
        if name == "registry"
        else folder / name / PART_MANIFEST
    )
    if not path.is_file():
        raise BackupDamaged(f"{name}: {path.relative_to(folder)} missing")
    if file_sha256(path) != taken.manifest_sha256:
        raise BackupDamaged(f"{name}: its manifest's sha256 is not the one recorded: changed")


def restore_mesh(
    mesh: RunningMesh,
    folder: Path,
    *,
    parts: Sequence[str],
    store_client: Callable[[], Any],
    registry_restore: Callable[[Path, str], Any],
) -> WholeRestored:
    """Check every asked-for part of the backup in `folder`, then put back what the mesh
    lost, part by part. `registry_restore(folder, snapshot)` puts the registry's part back
    through its API (the caller holds the channel and the credential)."""
    from servemesh.features.backup import read_manifest, restore, verified_records
    from servemesh.predlog.buffer import predictions_dir
    from servemesh.registry.backup import check_snapshot

    manifest = read_whole_manifest(folder)
    missing = [p for p in parts if p not in manifest.parts]
    if missing:
        why = {p: manifest.not_backed_up.get(p, "not in this backup") for p in missing}
        raise BackupDamaged(f"the backup has no part {missing}: {why}")
    manager = RouteManager(mesh.paths)
    # Everything checked before anything is written.
    checked: dict[str, Any] = {}
    for name in parts:
        taken = manifest.parts[name]
        _check_part_manifest(folder, name, taken)
        if name == "registry":
            problems = check_snapshot(folder / "registry", str(taken.summary["snapshot"]))
            if problems:
                raise BackupDamaged("registry: " + "; ".join(problems))
        elif name == "features":
            features = read_manifest(folder / "features")
            if features.prefix != mesh.spec.feature_store.key_prefix:
                raise BackupDamaged(
                    f"features: keys under {features.prefix!r}; this mesh's are under "
                    f"{mesh.spec.feature_store.key_prefix!r}"
                )
            verified_records(folder / "features", features)
        elif name == "predictions":
            checked[name] = verify_predictions(folder / "predictions")
        elif name == "routes":
            checked[name] = check_routes(folder / "routes", manager)
    began = time.perf_counter()
    result = WholeRestored(round(manifest.age_s(), 1), 0.0)
    for name in parts:
        start = time.perf_counter()
        detail: Any
        if name == "registry":
            detail = registry_restore(
                folder / "registry", str(manifest.parts[name].summary["snapshot"])
            )
        elif name == "features":
            client = store_client()
            try:
                detail = restore(
                    client, folder / "features", prefix=mesh.spec.feature_store.key_prefix
                )
            finally:
                client.close()
        elif name == "predictions":
            root = predictions_dir(mesh.spec.state_dir)
            detail = restore_predictions(folder / "predictions", root, checked[name])
        else:
            detail = restore_routes(folder / "routes", manager, checked[name])
        result.parts[name] = PartRestored(round(time.perf_counter() - start, 3), _plain(detail))
    result.seconds = round(time.perf_counter() - began, 3)
    return result


def _plain(detail: Any) -> dict[str, Any]:
    return asdict(detail) if hasattr(detail, "__dataclass_fields__") else dict(detail)
