"""`servemesh features load FILE --view NAME --key COLUMN [--timestamp COLUMN]`, and
`servemesh features backup|restore` (servemesh/features/backup.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from servemesh.cli.flags import add_duration, add_output
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import console, out, write
from servemesh.contract.control_credential import ControlCredentialMissing, control_metadata_for

if TYPE_CHECKING:
    from servemesh.features._send import LoadSummary


def cmd_load(args: argparse.Namespace) -> int:
    """Load a CSV or Parquet file into a view of the running mesh; 0 once it is current."""
    mesh = running_mesh(args)
    # pyarrow's thread pools may still be winding down a CSV reader's read-ahead when the
    # interpreter tears down, and C++ then aborts the process ("terminate called without an
    # active exception"): now and then exit 1 became -6. The command's work is done by
    # then, so `main` leaves without the interpreter's teardown.
    args.exit_without_teardown = True
    # pyarrow loads only for this command, not for every `servemesh` call.
    from servemesh.features import (
        DEFAULT_BATCH_ROWS,
        BadFile,
        FeatureFile,
        LoadError,
        feature_addresses,
        load_file,
    )

    spec = mesh.spec
    try:
        try:
            credential = control_metadata_for(mesh.state_dir)
        except ControlCredentialMissing as exc:
            raise LoadError(str(exc)) from None
        view = spec.feature_views.get(args.view)
        if view is None:
            raise LoadError(
                f"--view {args.view}: not a feature view of the running mesh; "
                f"its views: {', '.join(sorted(spec.feature_views))}"
            )
        file = FeatureFile(args.file, args.format, args.batch_rows or DEFAULT_BATCH_ROWS)
        layout = file.layout(args.key, args.timestamp, view.features)
        addresses = feature_addresses(spec, args.address)
        with _progress(file.total_rows) as progress:
            summary = load_file(
                addresses,
                file,
                layout,
                view=args.view,
                allow_nan=view.allow_nan,
                max_message_bytes=spec.limits.max_message_bytes,
                credential=credential,
                progress=progress,
                timeout=args.timeout,
            )
    except BadFile as exc:
        console.print(exc.report(), markup=False)
        console.print(f"[red]view {args.view!r} is as it was[/red]")
        return 1
    _summary(summary, args.file)
    return 0


@contextmanager
def _progress(total: int | None) -> Iterator[Callable[[int], None]]:
    """A rich progress bar of rows sent, with rows/s, on stderr; yields its update."""
    progress = Progress(
        TextColumn("loading"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rows  {task.fields[rate]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,  # in a pipe or a log, the summary says it all
    )
    task = progress.add_task("load", total=total, rate="")

    def update(rows: int) -> None:
        elapsed = progress.tasks[task].elapsed or 0.0
        rate = f"{rows / elapsed:,.0f} rows/s" if elapsed > 0 else ""
        progress.update(task, completed=rows, rate=rate)

    with progress:
        yield update


def _summary(summary: LoadSummary, file: str) -> None:
    replaced = (
        f"; version {summary.replaced_version} replaced ({summary.deleted_keys:,} keys deleted)"
        if summary.replaced_version
        else ""
    )
    out.print(
        f"loaded {Path(file).name}: {summary.rows:,} rows, {summary.entities:,} entities "
        f"into view {summary.view!r} as version {summary.version} in {summary.seconds:.2f} s "
        f"({summary.rows_per_second:,.0f} rows/s){replaced}"
    )
    if summary.replicas_acknowledged == 0:
        out.print(
            "warning: no replica of the store held the load when it was acknowledged: the "
            "primary has it, and a failover now could lose it; load the file again to be sure",
            markup=False,
        )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    features = sub.add_parser("features", help="load feature files into the online store")
    add_mesh_flags(features)
    verbs = features.add_subparsers(dest="verb", required=True)
    load = verbs.add_parser(
        "load",
        help="replace a feature view with a CSV or Parquet file, all or nothing",
        description="Every row is checked first; a file with problems loads nothing and "
        "the report names each problem's line (CSV) or row (Parquet) and column. A good file "
        "becomes the view's current version in one step.",
    )
    load.add_argument("file", help="a .csv (or .csv.gz) or .parquet file")
    load.add_argument("--view", required=True, help="the feature view to replace")
    load.add_argument("--key", required=True, help="the column of entity ids")
    load.add_argument(
        "--timestamp",
        help="the column of event times (ISO 8601, or seconds since the Unix epoch); "
        "default: every row is as old as the load",
    )
    load.add_argument("--format", choices=["csv", "parquet"], help="default: by file suffix")
    add_mesh_flags(load, inherited=True)
    load.add_argument("--address", help="a feature service (default: the running mesh's)")
    load.add_argument(
        "--batch-rows", type=int, help="rows read from the file at a time (default 65536)"
    )
    add_duration(load, "--timeout", "give up after this long", dest="timeout")
    load.set_defaults(func=cmd_load, error_label="not loaded")
    register_backup(verbs)


def cmd_backup(args: argparse.Namespace) -> int:
    """Every key of the running mesh's feature store into a folder, with its manifest."""
    from servemesh.features.backup import back_up
    from servemesh.spec.store_clients import store_writer_sync

    mesh = running_mesh(args)
    client = store_writer_sync(mesh.spec)
    try:
        manifest = back_up(client, mesh.spec.feature_store.key_prefix, Path(args.out))
    finally:
        client.close()
    if args.json:
        write(json.dumps(asdict(manifest)))
        return 0
    out.print(
        f"backed up {manifest.keys:,} keys ({manifest.bytes:,} bytes) into {args.out} in "
        f"{manifest.seconds:g} s; sha256 {manifest.sha256[:16]}…",
        markup=False,
    )
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    """Put a backup's keys back into the running mesh's feature store, once it verified."""
    from servemesh.features.backup import restore
    from servemesh.spec.store_clients import store_writer_sync

    mesh = running_mesh(args)
    client = store_writer_sync(mesh.spec)
    try:
        done = restore(client, Path(args.backup), prefix=mesh.spec.feature_store.key_prefix)
    finally:
        client.close()
    if args.json:
        write(json.dumps(asdict(done)))
        return 0
    out.print(
        f"restored {done.keys:,} keys in {done.seconds:g} s (the time to recover); the "
        f"backup was {done.age_s:g} s old (what was written since it is what it lacks)",
        markup=False,
    )
    return 0


def register_backup(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    backup = verbs.add_parser(
        "backup",
        help="every key of the online store into a folder, while the mesh serves",
        description="A folder with feature-store.jsonl (each key as Redis serializes it, "
        "with its time to live) and manifest.json (its sha256, counts, when). Keys are read "
        "one by one: take it between feature loads (docs/operators.md).",
    )
    backup.add_argument("--out", required=True, help="the folder to write (replaced whole)")
    add_mesh_flags(backup, inherited=True)
    add_output(backup)
    backup.set_defaults(func=cmd_backup, error_label="not backed up")
    restore = verbs.add_parser(
        "restore",
        help="put a backup's keys back, once its sha256 verified (nothing changes otherwise)",
    )
    restore.add_argument("backup", help="a folder `features backup` wrote")
    add_mesh_flags(restore, inherited=True)
    add_output(restore)
    restore.set_defaults(func=cmd_restore, error_label="not restored")
