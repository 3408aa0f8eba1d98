"""`servemesh trace`: one trace as a waterfall, or the slowest traces of a recent window."""

from __future__ import annotations

import argparse
import re
import secrets
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from servemesh.durations import duration_seconds
from servemesh.spec import SpecError, load_spec
from servemesh.tracestore.receiver import store_path
from servemesh.tracestore.store import TraceStore
from servemesh.tracestore.waterfall import slowest_table, waterfall

_DURATION = re.compile(r"^(\d+(ms|s|m|h|d))+$")
# Wide enough for the waterfall when the output is not a terminal (a file, a pipe).
_PIPE_WIDTH = 160


def new_traceparent() -> tuple[str, str]:
    """A W3C `traceparent` with the sampled flag set, and its trace id: a caller forcing a
    trace (the mesh's sampling is parent-based, so every hop records it)."""
    trace_id = secrets.token_hex(16)
    return f"00-{trace_id}-{secrets.token_hex(8)}-01", trace_id


def cmd_trace(args: argparse.Namespace) -> int:
    console = Console(width=args.width or (None if Console().is_terminal else _PIPE_WIDTH))
    errors = Console(stderr=True)
    if (args.ref is None) == (args.slowest is None):
        errors.print("[red]give a request id or trace id, or --slowest N[/red]")
        return 2
    if not _DURATION.match(args.since):
        errors.print(f"[red]--since {args.since[:20]!r}: a duration such as 90s, 5m, 1h[/red]")
        return 2
    try:
        state_dir = args.state_dir or load_spec(args.spec).state_dir
    except SpecError as exc:
        errors.print(f"[red]{exc}[/red]")
        return 2
    path = store_path(state_dir)
    if not path.exists():
        errors.print(f"[red]no trace store at {path}: is the mesh's tracing on?[/red]")
        return 1
    store = TraceStore(Path(path))
    try:
        if args.slowest is not None:
            since_ns = time.time_ns() - int(duration_seconds(args.since) * 1e9)
            found = store.slowest(args.slowest, since_ns)
            title = f"slowest {args.slowest} traces of the last {args.since}"
            console.print(slowest_table(found, title))
            return 0
        trace_id = store.find(args.ref)
        if trace_id is None:
            errors.print(
                f"[red]no trace for {args.ref[:64]!r}[/red] (not sampled, not exported yet, "
                "or past retention)"
            )
            return 1
        console.print(waterfall(store.trace(trace_id)))
        return 0
    finally:
        store.close()


def add_trace_parser(sub: Any) -> None:
    trace = sub.add_parser(
        "trace", help="draw a request's trace as a waterfall, or list the slowest traces"
    )
    trace.add_argument("ref", nargs="?", help="a request id (as Predict answers) or a trace id")
    trace.add_argument("--slowest", type=int, metavar="N", help="list the N slowest traces")
    trace.add_argument(
        "--since", default="15m", help="with --slowest: traces started this long ago (15m)"
    )
    trace.add_argument("--spec", help="the mesh's spec (default: ./mesh.yaml)")
    trace.add_argument("--state-dir", help="the running mesh's state dir")
    trace.add_argument("--width", type=int, help="output width in columns")
    trace.set_defaults(func=cmd_trace)
