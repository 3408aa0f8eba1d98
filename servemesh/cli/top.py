"""`servemesh top`: the live mesh, refreshed (servemesh/observe/top.py measures it)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from servemesh.cli.flags import add_duration, add_output
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out, write
from servemesh.observe.top import measure, render


def cmd_top(args: argparse.Namespace) -> int:
    from rich.live import Live

    mesh = running_mesh(args)
    if args.json or args.once:
        report = measure(mesh, args.source, args.window, args.interval)
        if args.json:
            write(json.dumps(report.as_dict(), indent=2))
        else:
            out.print(render(report))
        return 0
    with Live(auto_refresh=False) as live:
        try:
            while True:
                live.update(render(measure(mesh, args.source, args.window, args.interval)))
                live.refresh()
        except KeyboardInterrupt:
            return 0


def register(sub: Any) -> None:
    top = sub.add_parser(
        "top", help="the live mesh: req/s, errors, p50/p99 per service, version and zone, cost"
    )
    add_mesh_flags(top)
    add_duration(
        top,
        "--interval",
        "between refreshes and scrapes (default 2s)",
        dest="interval",
        default=2.0,
    )
    add_duration(
        top, "--window", "what Prometheus's rates cover (default 30s)", dest="window", default=30.0
    )
    top.add_argument(
        "--source",
        choices=["auto", "prometheus", "direct"],
        default="auto",
        help="auto: Prometheus when the mesh runs one, else every service's /metrics",
    )
    top.add_argument("--once", action="store_true", help="print one report and exit")
    add_output(top, "one report as JSON (implies --once)")
    top.set_defaults(func=cmd_top)
