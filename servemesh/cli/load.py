"""`servemesh load`: steady Predict traffic through a running mesh's edge, for trying a
rollout, a route change or a drill by hand, and a summary of what it met: calls sent and
failed (by status), latency, and which versions answered. It sends the credentials the
edge's auth mode asks for, as `servemesh predict` does (a token it signs, or the basic key)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
from collections import Counter
from typing import Any

from rich.table import Table

from servemesh.cli.flags import add_duration, add_output, add_rate, deprecated
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import console, out, write
from servemesh.contract.errors import ServemeshError
from servemesh.identity.channels import dial_every_edge
from servemesh.load import FixedRate, LoadRun, open_loop, predict_target, summarize
from servemesh.state.credentials import EdgeAuthMetadata

# The subject of the tokens `load` signs for its calls (jwt edge auth).
LOAD_CALLER = "servemesh-load"


def report_data(run: LoadRun, seconds: float) -> dict[str, Any]:
    """What the summary shows: sent, answered, failed by status, latency (ms, None with no
    answers), and each answering version's share of the answers."""
    outcomes = run.window(0.0, seconds)
    summary = summarize(outcomes, seconds)
    versions = Counter(o.version or "?" for o in outcomes if o.ok)
    failed = Counter(o.code for o in outcomes if not o.ok)
    return {
        "predicts": len(outcomes),
        "seconds": seconds,
        "answered": summary.ok,
        "failed": dict(failed.most_common()),
        "p50_ms": None if math.isnan(summary.p50_ms) else summary.p50_ms,
        "p99_ms": None if math.isnan(summary.p99_ms) else summary.p99_ms,
        "answered_by": {v: n / max(1, summary.ok) for v, n in sorted(versions.items())},
    }


def report(run: LoadRun, seconds: float) -> Table:
    """One table: sent, answered, failed by status, latency, and the answering versions."""
    data = report_data(run, seconds)
    table = Table(
        title=f"{data['predicts']} Predicts over {seconds:g} s",
        title_justify="left",
        show_header=False,
    )
    table.add_column("")
    table.add_column("", justify="right")
    table.add_row("answered", f"{data['answered']}")
    table.add_row("failed", ", ".join(f"{c} {n}" for c, n in data["failed"].items()) or "0")
    p50, p99 = (math.nan if v is None else v for v in (data["p50_ms"], data["p99_ms"]))
    table.add_row("p50 / p99 ms", f"{p50:.1f} / {p99:.1f}")
    table.add_row(
        "answered by", ", ".join(f"{v} {share:.0%}" for v, share in data["answered_by"].items())
    )
    return table


def cmd_load(args: argparse.Namespace) -> int:
    if args.rate <= 0 or args.seconds <= 0:
        raise ServemeshError("--rate and --duration must be above 0")
    spec = running_mesh(args).spec
    if args.model not in spec.models:
        raise ServemeshError(
            f"--model: {args.model!r} is not served; served: {sorted(spec.models)}"
        )
    target = predict_target(
        dial_every_edge(spec),
        model=args.model,
        entities=args.entities or spec.demo.entities,
        timeout_s=args.timeout,
        metadata=EdgeAuthMetadata(spec, LOAD_CALLER).metadata,
    )
    stop = threading.Event()
    console.print(
        f"{args.rate:g} Predict/s to {args.model} for {args.seconds:g} s through "
        f"{', '.join(spec.edge_addresses)} (Ctrl-C ends it early)"
    )
    run = LoadRun()
    try:
        asyncio.run(open_loop(target, FixedRate(args.rate, args.seconds), stop=stop, run=run))
    except KeyboardInterrupt:
        stop.set()
    elapsed = min(args.seconds, max((o.sent_s for o in run.outcomes), default=0.0) + 1e-9)
    if args.json:
        write(json.dumps(report_data(run, elapsed)))
    else:
        out.print(report(run, elapsed))
    failed = sum(not o.ok for o in run.outcomes)
    if failed:
        raise ServemeshError(f"{failed} of {len(run.outcomes)} Predicts failed")
    return 0


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "load", help="steady Predict traffic through the running mesh's edge, then a summary"
    )
    parser.add_argument("--model", default="fraud")
    add_rate(parser, "Predicts/s", "the rate of calls sent (default 50)", default=50.0)
    add_duration(
        parser, "--duration", "how long to send them (default 60s)", dest="seconds", default=60.0
    )
    deprecated(parser, "--seconds", "--duration", dest="seconds", convert=float)
    parser.add_argument(
        "--entities", type=int, default=0, help="cycle user-0..user-N-1 (default: the demo's)"
    )
    add_duration(
        parser, "--timeout", "each call's deadline (default 2s)", dest="timeout", default=2.0
    )
    add_output(parser, "print the summary as JSON")
    add_mesh_flags(parser)
    parser.set_defaults(func=cmd_load)
