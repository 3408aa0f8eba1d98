"""`servemesh up`: start the whole mesh and keep it running until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from rich.table import Table

from servemesh.cli.output import console, out
from servemesh.spec import EDGE_PROXY, load_spec


def cmd_up(args: argparse.Namespace) -> int:
    from servemesh.launcher import Mesh, envoy_child
    from servemesh.procs import StartError

    spec = load_spec(args.spec)
    if args.netns:
        network = spec.network.model_copy(update={"mode": "netns"})
        spec = spec.model_copy(update={"network": network})
    mesh = Mesh.from_spec(spec, Path(args.state_dir) if args.state_dir else None)
    mesh.scaler = not args.no_scaler  # the scaler follows the traffic (docs/capacity.md)
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
    table = Table(title=title, title_justify="left")
    table.add_column("endpoint")
    table.add_column("address")
    table.add_column("pid", justify="right")
    endpoints = mesh.endpoints()
    pids = mesh.pids()
    table.add_row("edge (clients, grpcurl)", str(endpoints["edge"]), str(pids.get("envoy", "")))
    for zone in mesh.spec.zones:
        # Its own Envoy's PID in the per-zone layout; the edge's holds it in the shared one.
        own = pids.get(envoy_child(zone), "") if mesh.spec.proxy.layout == "per_zone" else ""
        table.add_row(f"mesh listener of {zone}", mesh.spec.mesh_address_for(zone), str(own))
    # A Unix socket (curl --unix-socket PATH http://localhost/...), not a TCP port.
    for proxy, socket in dict(endpoints["envoy_admins"]).items():  # type: ignore[call-overload]
        what = "envoy admin" if proxy == EDGE_PROXY else f"envoy admin of {proxy}"
        table.add_row(what, f"unix:{socket}", "")
    table.add_row("redis", str(endpoints["redis"]), str(pids.get("redis", "")))
    if endpoints.get("trace_store"):
        # `servemesh trace` reads what it stores; a collector of the spec's when no pid.
        table.add_row(
            "trace store (OTLP)", str(endpoints["trace_store"]), str(pids.get("tracestore", ""))
        )
    for inst in mesh.spec.instances():
        table.add_row(inst.name, mesh.spec.address_of(inst.name), str(pids.get(inst.name, "")))
    out.print(table)
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
    up.add_argument("--state-dir", help="where logs, the registry and rendered config go")
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
