"""The routes' part of a backup: each model's live weights and shadow, the routes' history,
what the rollouts recorded (their states and history), and the drift references kept under
the state dir (`servemesh drift MODEL --set-reference`).

A restore sets, live and through the route manager (recorded in the history like any
change), the weights and shadow of each model whose routes differ from the backup's; a
model the mesh no longer serves, or whose versions changed, is left and reported. It puts
back a history, a rollout record or a drift reference only where the mesh has none (a lost
state dir), never over one, and is refused while a rollout is under way: its controller
owns those weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servemesh.predlog.references import FOLDER as DRIFT
from servemesh.predlog.references import references_dir
from servemesh.proxy.apply import RouteManager
from servemesh.recovery.checksums import (
    BackupDamaged,
    CopiedFile,
    copy_hashed,
    hashed,
    verified_files,
    write_part_manifest,
)
from servemesh.state.rollouts import StateStore

ROUTES_FILE = "routes.json"
HISTORY_FILE = "routes-history.jsonl"
ROLLOUTS = "rollouts"


@dataclass(frozen=True)
class RoutesBackup:
    models: int
    files: int
    manifest_sha256: str


@dataclass
class RoutesRestored:
    changed: list[str] = field(default_factory=list)  # "fraud: v1=100 v2=0"
    unchanged: int = 0
    skipped: list[str] = field(default_factory=list)  # why a model was left
    records_put_back: list[str] = field(default_factory=list)


def live_routes(manager: RouteManager) -> dict[str, dict[str, Any]]:
    live = manager.live_spec()
    return {
        name: {
            "traffic": dict(model.traffic),
            "shadow": model.shadow.model_dump() if model.shadow is not None else None,
        }
        for name, model in sorted(live.models.items())
    }


def back_up_routes(manager: RouteManager, part: Path) -> RoutesBackup:
    part.mkdir(parents=True, exist_ok=True, mode=0o700)
    state_dir = manager.paths.state_dir
    routes = part / ROUTES_FILE
    routes.write_text(json.dumps(live_routes(manager), indent=1, sort_keys=True) + "\n")
    files = [hashed(part, ROUTES_FILE)]
    history = manager.paths.history
    if history.is_file():
        files.append(copy_hashed(history, part, HISTORY_FILE))
    rollouts = StateStore(state_dir)
    for path in sorted(rollouts.root.glob("*.json")) + [rollouts.history_path]:
        if path.is_file() and not path.name.startswith("."):
            files.append(copy_hashed(path, part, f"{ROLLOUTS}/{path.name}"))
    # A reference is a summary of a dataset that may be gone by the time a state dir is lost.
    for path in sorted(references_dir(state_dir).glob("*.json")):
        files.append(copy_hashed(path, part, f"{DRIFT}/{path.name}"))
    digest = write_part_manifest(part, files)
    models = len(json.loads(routes.read_text()))
    return RoutesBackup(models, len(files), digest)


def check_routes(part: Path, manager: RouteManager) -> list[CopiedFile]:
    """The part's files once verified; a refusal while a rollout is under way."""
    _summary, files = verified_files(part)
    store = StateStore(manager.paths.state_dir)
    running = [m for m in store.models() if (s := store.load(m)) is not None and s.active]
    if running:
        raise BackupDamaged(
            f"a rollout of {running} is under way and its controller owns those weights: "
            "restore the routes once it ended, or leave them out (--part)"
        )
    return files


def restore_routes(part: Path, manager: RouteManager, files: list[CopiedFile]) -> RoutesRestored:
    saved: dict[str, dict[str, Any]] = json.loads((part / ROUTES_FILE).read_text())
    live = manager.live_spec()
    result = RoutesRestored()
    for model, routes in saved.items():
        served = live.models.get(model)
        if served is None:
            result.skipped.append(f"{model}: not served now")
            continue
        traffic: dict[str, int] = routes["traffic"]
        missing = sorted(set(traffic) - set(served.versions))
        if missing:
            result.skipped.append(f"{model}: the mesh serves no version {missing} now")
            continue
        now_shadow = served.shadow.model_dump() if served.shadow is not None else None
        full = {v: traffic.get(v, 0) for v in served.versions}
        if full == {v: served.traffic.get(v, 0) for v in served.versions} and (
            routes["shadow"] == now_shadow
        ):
            result.unchanged += 1
            continue
        manager.set_weights(model, full, who="servemesh restore", reason="from a backup")
        shadow = routes["shadow"]
        if shadow != now_shadow:
            if shadow is None:
                manager.set_shadow(model, None, who="servemesh restore")
            else:
                manager.set_shadow(
                    model, shadow["version"], shadow["percent"], who="servemesh restore"
                )
        result.changed.append(f"{model}: " + " ".join(f"{v}={w}" for v, w in full.items()))
    state_dir = manager.paths.state_dir
    for entry in files:
        if entry.path == ROUTES_FILE:
            continue
        target = manager.paths.history if entry.path == HISTORY_FILE else state_dir / entry.path
        if not target.exists():
            copy_hashed(part / entry.path, target.parent, target.name)
            result.records_put_back.append(entry.path)
    return result
