"""`servemesh edge sync`: keep a device folder's copy of an alias's model current.

Talks to the registry of the mesh the flags point at (its address and mTLS from the state
dir, as every registry read); the call is a read, no control credential. The registry
answers "not modified" without a byte when the folder already holds the alias's artifact;
otherwise the download is verified (size and sha256) and swapped in atomically, and a
truncated or altered one is refused with the held file kept (servemesh/edge/sync.py).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out
from servemesh.contract.wire import message_size_options
from servemesh.identity import dial_registry


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def cmd_sync(args: argparse.Namespace) -> int:
    from servemesh.edge.sync import sync

    mesh = running_mesh(args)
    spec = mesh.spec

    async def run() -> object:
        channel = dial_registry(spec).aio_channel(
            options=message_size_options(spec.limits.max_message_bytes)
        )
        async with channel:
            return await sync(
                channel,
                model=args.model,
                alias=args.alias,
                directory=Path(args.dir),
                format=args.format,
                max_bytes=spec.limits.max_artifact_bytes,
                atol=args.atol,
                rtol=args.rtol,
            )

    synced = asyncio.run(run())
    from servemesh.edge.sync import Synced

    assert isinstance(synced, Synced)
    if not synced.changed:
        out.print(
            f"{synced.model} {synced.alias}: not modified: {synced.path} is {synced.version} "
            f"(sha256 {synced.sha256}); 0 bytes received",
            highlight=False,
            markup=False,
        )
        return 0
    was = f" (was {synced.previous_version})" if synced.previous_version else ""
    out.print(
        f"{synced.model} {synced.alias} -> {synced.version}: received "
        f"{_size(synced.bytes_received)}, sha256 {synced.sha256} verified",
        highlight=False,
        markup=False,
    )
    out.print(f"swapped in {synced.path}{was}", highlight=False, markup=False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    edge = sub.add_parser("edge", help="models on devices: sync an alias's artifact to a folder")
    add_mesh_flags(edge)
    verbs = edge.add_subparsers(dest="verb", required=True)

    sync_ = verbs.add_parser(
        "sync",
        help="download the alias's artifact if it changed (sha256-verified), swap it in "
        "atomically; 'not modified' costs no bytes",
    )
    add_mesh_flags(sync_, inherited=True)
    sync_.add_argument("--model", required=True)
    sync_.add_argument("--alias", required=True, help="an alias (e.g. production) or a version")
    sync_.add_argument("--dir", required=True, help="the device's model folder")
    sync_.add_argument(
        "--format",
        choices=("artifact", "onnx"),
        default="artifact",
        help="artifact: the registry's file as stored (.pt2 or .pt); onnx: exported and "
        "checked in onnxruntime before the swap (needs the edge extra)",
    )
    sync_.add_argument("--atol", type=float, default=None, help="onnx check (default 1e-4)")
    sync_.add_argument("--rtol", type=float, default=None, help="onnx check (default 1e-3)")
    sync_.set_defaults(func=cmd_sync, error_label="edge sync")
