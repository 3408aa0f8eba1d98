"""`servemesh backup` / `servemesh restore`: every store of a running mesh in one folder
(the registry, the feature store, the prediction log, the routes and rollouts), and its
restore, every part verified before anything is written (servemesh/recovery/,
docs/operators.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
from rich.table import Table

from servemesh.cli.flags import add_output
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out, write
from servemesh.contract.errors import ServemeshError, UsageError

PART_NAMES = ("registry", "features", "predictions", "routes")


def _store_client(spec: Any) -> Any:
    from servemesh.spec.store_clients import store_writer_sync

    return lambda: store_writer_sync(spec)


def cmd_backup(args: argparse.Namespace) -> int:
    from servemesh.recovery.whole import back_up_mesh

    mesh = running_mesh(args)
    target = Path(args.out)
    manifest = back_up_mesh(mesh, target, store_client=_store_client(mesh.spec))
    if args.json:
        write(json.dumps(asdict(manifest)))
        return 0
    rows = [
        (name, ", ".join(f"{k} {v}" for k, v in part.summary.items()), f"{part.seconds:g}")
        for name, part in manifest.parts.items()
    ]
    rows += [(name, f"not backed up: {why}", "") for name, why in manifest.not_backed_up.items()]
    out.print(_parts_table(f"backup {target} ({manifest.taken_at})", rows))
    out.print(f"whole backup in {manifest.seconds:g} s", markup=False)
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from servemesh.contract.control_credential import ControlCredentialMissing, control_metadata_for
    from servemesh.contract.wire import message_size_options
    from servemesh.identity import dial_registry
    from servemesh.recovery.whole import restore_mesh
    from servemesh.registry.backup import restore

    mesh = running_mesh(args)
    folder = Path(args.backup)
    if not folder.is_dir():
        raise UsageError(f"{folder}: no such backup folder")
    parts = args.part or list(PART_NAMES)
    spec = mesh.spec

    def registry_restore(registry_dir: Path, snapshot: str) -> Any:
        try:
            credential = control_metadata_for(mesh.state_dir)
        except ControlCredentialMissing as exc:
            raise ServemeshError(" ".join(str(exc).split())) from None
        options = message_size_options(spec.limits.max_message_bytes)

        async def run() -> Any:
            async with dial_registry(spec).aio_channel(options=options) as channel:
                return await restore(
                    registry_dir,
                    snapshot,
                    channel,
                    credential,
                    max_artifact_bytes=spec.limits.max_artifact_bytes,
                    missing_only=True,
                )

        try:
            return asyncio.run(run())
        except grpc.aio.AioRpcError as exc:
            raise ServemeshError(
                f"the registry at {spec.registry_address}: {exc.code().name}: {exc.details()}"
            ) from None

    done = restore_mesh(
        mesh,
        folder,
        parts=parts,
        store_client=_store_client(spec),
        registry_restore=registry_restore,
    )
    if args.json:
        write(json.dumps(asdict(done)))
        return 0
    rows = [
        (name, _restored_text(name, part.detail), f"{part.seconds:g}")
        for name, part in done.parts.items()
    ]
    out.print(_parts_table(f"restored from {folder}", rows))
    out.print(
        f"recovery time {done.seconds:g} s; recovery point: the backup was "
        f"{done.backup_age_s:g} s old (what was written since is not in it)",
        markup=False,
    )
    return 0


def _parts_table(title: str, rows: list[tuple[str, str, str]]) -> Table:
    """A row per part: its name, what was done with it, how long it took."""
    table = Table(title=title, title_justify="left")
    for column in ("part", "what", "seconds"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def _restored_text(part: str, detail: dict[str, Any]) -> str:
    """What one part put back, in words."""
    if part == "registry":
        text = (
            f"{detail['versions']} versions and {detail['aliases']} aliases put back, "
            f"{detail['already_there']} versions held already"
        )
        kept = detail.get("aliases_kept") or []
        return text + (f"; aliases moved since, kept: {', '.join(kept)}" if kept else "")
    if part == "features":
        return f"{detail['keys']:,} keys written back"
    if part == "predictions":
        return f"{detail['files']} files put back, {detail['already_there']} held already"
    changed = detail.get("changed") or []
    words = [f"set {c}" for c in changed] or ["every model's routes as in the backup"]
    words += [f"left {s}" for s in detail.get("skipped") or []]
    words += [f"put back {r}" for r in detail.get("records_put_back") or []]
    return "; ".join(words)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    backup = sub.add_parser(
        "backup",
        help="every store of the running mesh into one folder, while it serves",
        description="The registry (a snapshot), the feature store (every key), the "
        "prediction log (its files) and the routes (live weights, their history, the "
        "rollouts' records), each with its manifest and sha256 (docs/operators.md).",
    )
    backup.add_argument("--out", required=True, help="a new (or empty) folder to write")
    add_mesh_flags(backup)
    add_output(backup)
    backup.set_defaults(func=cmd_backup, error_label="not backed up")

    restore = sub.add_parser(
        "restore",
        help="put back what the mesh lost from a backup, once every part verified",
        description="Every part asked for is checked first (sha256, counts); one that "
        "does not verify refuses the whole restore and nothing changes. Each part then "
        "puts back what is missing and leaves what the mesh holds.",
    )
    restore.add_argument("backup", help="a folder `servemesh backup` wrote")
    restore.add_argument(
        "--part",
        action="append",
        choices=PART_NAMES,
        help="restore only this part (repeat for several; default: every part)",
    )
    add_mesh_flags(restore)
    add_output(restore)
    restore.set_defaults(func=cmd_restore, error_label="not restored")
