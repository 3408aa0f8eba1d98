"""`servemesh registry backup|snapshots|restore`: the registry's disaster recovery
(registry/backup.py, docs/registry.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from rich.table import Table

from servemesh.cli.flags import add_output, deprecated
from servemesh.cli.mesh import add_mesh_flags, running_mesh, state_dir_of
from servemesh.cli.output import out, write
from servemesh.contract.errors import ServemeshError, UsageError

if TYPE_CHECKING:
    from servemesh.registry.backup import Restored
    from servemesh.spec import MeshSpec


def _local_spec(args: argparse.Namespace) -> MeshSpec:
    """The spec, its state dir the one the flags name (the registry's store is under it)."""
    from servemesh.spec import load_spec

    spec = load_spec(getattr(args, "spec", None))
    return spec.model_copy(update={"state_dir": str(state_dir_of(args))})


def _backup_dir(args: argparse.Namespace) -> Path:
    given = getattr(args, "out", None) or getattr(args, "backup_dir", None)
    return Path(given) if given else _local_spec(args).registry_backup_dir


def cmd_backup(args: argparse.Namespace) -> int:
    from servemesh.registry.backup import take_backup

    store = _local_spec(args).registry_store_dir
    target = _backup_dir(args)
    manifest = take_backup(store, target, keep=args.keep)
    if args.json:
        write(json.dumps(asdict(manifest)))
        return 0
    out.print(
        f"snapshot {manifest.snapshot} in {target}: {len(manifest.versions)} versions of "
        f"{len({e.model for e in manifest.versions})} models, "
        f"{sum(len(a) for a in manifest.aliases.values())} aliases; "
        f"{manifest.new_blobs} new artifacts ({manifest.copied_bytes:,} bytes) in "
        f"{manifest.seconds:g} s" + (f"; pruned {len(manifest.pruned)}" if manifest.pruned else ""),
        markup=False,
    )
    return 0


def cmd_snapshots(args: argparse.Namespace) -> int:
    from servemesh.registry.backup import read_manifest, snapshots

    target = _backup_dir(args)
    names = snapshots(target)
    rows = [read_manifest(target, name) for name in names]
    if args.json:
        write(json.dumps([{**asdict(m), "versions": m.names()} for m in rows]))
        return 0
    if not rows:
        out.print(f"no snapshot in {target}", markup=False)
        return 0
    table = Table(title=str(target))
    for column in ("snapshot", "taken (UTC)", "versions", "aliases", "new artifacts"):
        table.add_column(column)
    for m in rows:
        table.add_row(
            m.snapshot,
            m.taken_at,
            str(len(m.versions)),
            str(sum(len(a) for a in m.aliases.values())),
            str(m.new_blobs),
        )
    out.print(table)
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from servemesh.contract.control_credential import ControlCredentialMissing, control_metadata_for
    from servemesh.contract.wire import message_size_options
    from servemesh.identity import dial_registry
    from servemesh.registry.backup import restore

    mesh = running_mesh(args)
    source = Path(args.backup)
    if not source.is_dir():
        raise UsageError(f"{source}: no such backup folder")
    try:
        credential = control_metadata_for(mesh.state_dir)
    except ControlCredentialMissing as exc:
        raise ServemeshError(" ".join(str(exc).split())) from None
    options = message_size_options(mesh.spec.limits.max_message_bytes)

    def shown(name: str) -> None:
        if not args.json:
            out.print(f"  restored {name}", markup=False)

    async def run() -> Restored:
        async with dial_registry(mesh.spec).aio_channel(options=options) as channel:
            return await restore(
                source,
                args.snapshot,
                channel,
                credential,
                max_artifact_bytes=mesh.spec.limits.max_artifact_bytes,
                progress=shown,
            )

    try:
        done = asyncio.run(run())
    except grpc.aio.AioRpcError as exc:
        raise ServemeshError(
            f"the registry at {mesh.spec.registry_address}: {exc.code().name}: {exc.details()}"
        ) from None
    if args.json:
        write(json.dumps(asdict(done)))
        return 0
    out.print(
        f"restored snapshot {done.snapshot}: {done.models} models, {done.versions} versions, "
        f"{done.aliases} aliases in {done.seconds:g} s",
        markup=False,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    registry = sub.add_parser("registry", help="the model registry's backups and their restore")
    add_mesh_flags(registry)
    verbs = registry.add_subparsers(dest="verb", required=True)
    backup = verbs.add_parser(
        "backup",
        help="an online, consistent snapshot of the registry's store (running or not): its "
        "metadata and every artifact not in the folder yet, each checked as it is copied",
    )
    add_mesh_flags(backup, inherited=True)
    backup.add_argument(
        "--out", help="the backup folder (default: registry.backup.directory, else "
        "<state_dir>/registry-backups)",
    )  # fmt: skip
    backup.add_argument("--keep", type=int, help="then keep only the newest N snapshots")
    add_output(backup)
    backup.set_defaults(func=cmd_backup)
    listed = verbs.add_parser("snapshots", help="the snapshots of a backup folder")
    add_mesh_flags(listed, inherited=True)
    listed.add_argument("--backup-dir", help="the backup folder read (default as for backup)")
    deprecated(listed, "--out", "--backup-dir", dest="backup_dir")
    add_output(listed)
    listed.set_defaults(func=cmd_snapshots)
    rest = verbs.add_parser(
        "restore",
        help="check a snapshot whole (every artifact's size and sha256, the database), then "
        "restore its models, versions and aliases into the running mesh's empty registry",
    )
    add_mesh_flags(rest, inherited=True)
    rest.add_argument("backup", help="the backup folder")
    rest.add_argument("--snapshot", help="which snapshot (default: the newest)")
    add_output(rest)
    rest.set_defaults(func=cmd_restore)
