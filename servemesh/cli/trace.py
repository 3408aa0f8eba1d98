"""`servemesh trace`: one trace as a waterfall, or the slowest traces of a recent window."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

from servemesh.cli.mesh import add_mesh_flags, recorded_state_dir
from servemesh.cli.output import sized
from servemesh.durations import duration_seconds
from servemesh.errors import ServemeshError, UsageError
from servemesh.tracestore.receiver import store_path
from servemesh.tracestore.store import TraceStore
from servemesh.tracestore.waterfall import slowest_table, waterfall

_DURATION = re.compile(r"^(\d+(ms|s|m|h|d))+$")


def cmd_trace(args: argparse.Namespace) -> int:
    console = sized(args.width)
    if (args.ref is None) == (args.slowest is None):
        raise UsageError("give a request id or trace id, or --slowest N")
    if not _DURATION.match(args.since):
        raise UsageError(f"--since {args.since[:20]!r}: a duration such as 90s, 5m, 1h")
    # A stopped mesh's traces stay readable; with neither a mesh nor its traces, no mesh.
    state_dir = recorded_state_dir(args, "traces")
    path = store_path(state_dir)
    if not path.exists():
        raise ServemeshError(f"no trace store at {path}: is the mesh's tracing on?")
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
            raise ServemeshError(
                f"no trace for {args.ref[:64]!r} (not sampled, not exported yet, or past retention)"
            )
        console.print(waterfall(store.trace(trace_id)))
        return 0
    finally:
        store.close()


def register(sub: Any) -> None:
    trace = sub.add_parser(
        "trace", help="draw a request's trace as a waterfall, or list the slowest traces"
    )
    trace.add_argument("ref", nargs="?", help="a request id (as Predict answers) or a trace id")
    trace.add_argument("--slowest", type=int, metavar="N", help="list the N slowest traces")
    trace.add_argument(
        "--since", default="15m", help="with --slowest: traces started this long ago (15m)"
    )
    add_mesh_flags(trace)
    trace.add_argument("--width", type=int, help="output width in columns")
    trace.set_defaults(func=cmd_trace)
