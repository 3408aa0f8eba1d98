"""`servemesh up`: start the whole mesh and keep it running until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from servemesh.cli.endpoint_table import endpoint_rows, endpoint_table
from servemesh.cli.output import console, out
from servemesh.spec import load_spec


def cmd_up(args: argparse.Namespace) -> int:
    from servemesh.launcher import Mesh
    from servemesh.procs import StartError

    spec = load_spec(args.spec)
    if args.netns:
        network = spec.network.model_copy(update={"mode": "netns"})
        spec = spec.model_copy(update={"network": network})
    mesh = Mesh.from_spec(spec, Path(args.state_dir) if args.state_dir else None)
    mesh.scaler = not args.no_scaler  # the scaler follows the traffic (docs/capacity.md)
    # Held until the mesh stops: a second `up` here is refused (StateDirHeld, exit 4).
    gone = mesh.hold_state_dir()
    if gone is not None:
        console.print(
            f"note: taking over {mesh.state_dir} from a mesh that was not stopped "
            f"(pid {gone.pid}, edge {gone.edge}, no longer running)",
            markup=False,
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = time.perf_counter()
    with console.status(
        "starting the mesh (Redis, registry, models, features, gateways, Envoy)..."
    ):
        try:
            mesh.start()
        except StartError as exc:
            console.print(f"[red]the mesh did not start:[/red] {exc}")
            return 1
    elapsed = time.perf_counter() - started
    title = f"servemesh is up ({elapsed:.1f} s, profile {mesh.spec.profile})"
    endpoints = mesh.endpoints()
    out.print(endpoint_table(title, endpoint_rows(mesh.spec, endpoints), mesh.pids()))
    out.print(f"logs: {endpoints['logs']}")
    out.print(f"try:  {sys.argv[0]} predict --model fraud --entity user-42")
    out.print("Ctrl-C stops the mesh")
    sys.stdout.flush()
    try:
        while not stop.wait(0.5):
            for child in mesh.reap_exited():
                console.print(f"[yellow]{child.name} exited with {child.returncode}[/yellow]")
    finally:
        with console.status("stopping..."):
            mesh.stop()
    out.print("stopped")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = sub.add_parser("up", help="start the whole mesh and keep it running until Ctrl-C")
    up.add_argument("--spec", help="mesh spec (default: ./mesh.yaml, else built-in defaults)")
    up.add_argument(
        "--state-dir",
        help="where logs, the registry and rendered config go; one mesh per state dir: "
        "refused (exit 4) while a running mesh holds it",
    )
    up.add_argument(
        "--no-scaler",
        action="store_true",
        help="keep every replica count fixed (the spec's scaling runs otherwise)",
    )
    up.add_argument(
        "--netns",
        action="store_true",
        help="run each zone's services in a network namespace of its own (root; partitions): "
        "sets the spec's network.mode to netns",
    )
    up.set_defaults(func=cmd_up)
