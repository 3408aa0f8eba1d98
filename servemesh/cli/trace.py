"""`servemesh trace`: one trace as a waterfall, or the slowest traces of a recent window."""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from servemesh.cli.flags import add_output
from servemesh.cli.mesh import add_mesh_flags, recorded_state_dir
from servemesh.cli.output import sized, write
from servemesh.contract.errors import ServemeshError, UsageError
from servemesh.spec.durations import duration_seconds
from servemesh.tracestore.hops import hop_groups, hops_tables
from servemesh.tracestore.receiver import store_path
from servemesh.tracestore.store import TraceStore
from servemesh.tracestore.waterfall import (
    slowest_data,
    slowest_table,
    waterfall,
    waterfall_data,
)

_DURATION = re.compile(r"^(\d+(ms|s|m|h|d))+$")


def cmd_trace(args: argparse.Namespace) -> int:
    console = sized(args.width)
    asked = [args.ref is not None, args.slowest is not None, args.hops is not None]
    if sum(asked) != 1:
        raise UsageError("give a request id or trace id, or --slowest N, or --hops N")
    for flag, count in (("--slowest", args.slowest), ("--hops", args.hops)):
        if count is not None and count < 1:
            raise UsageError(f"{flag}: at least 1 trace, not {count}")
    if not _DURATION.match(args.since):
        raise UsageError(f"--since {args.since[:20]!r}: a duration such as 90s, 5m, 1h")
    # A stopped mesh's traces stay readable; with neither a mesh nor its traces, no mesh.
    state_dir = recorded_state_dir(args, "traces")
    path = store_path(state_dir)
    if not path.exists():
        raise ServemeshError(f"no trace store at {path}: is the mesh's tracing on?")
    store = TraceStore(Path(path))
    try:
        since_ns = time.time_ns() - int(duration_seconds(args.since) * 1e9)
        if args.slowest is not None:
            found = store.slowest(args.slowest, since_ns)
            if args.json:
                write(json.dumps(slowest_data(found)))
                return 0
            title = f"slowest {args.slowest} traces of the last {args.since}"
            console.print(slowest_table(found, title))
            return 0
        if args.hops is not None:
            latest = store.latest(args.hops, since_ns)
            if not latest:
                raise ServemeshError(f"no traces started in the last {args.since}")
            traces = [store.trace(summary.trace_id) for summary in latest]
            if args.json:
                write(json.dumps([asdict(group) for group in hop_groups(traces)]))
                return 0
            title = f"the last {len(traces)} traces of the last {args.since}"
            for table in hops_tables(traces, title):
                console.print(table)
            return 0
        trace_id = store.find(args.ref)
        if trace_id is None:
            raise ServemeshError(
                f"no trace for {args.ref[:64]!r} (not sampled, not exported yet, or past retention)"
            )
        if args.json:
            write(json.dumps(waterfall_data(store.trace(trace_id))))
        else:
            console.print(waterfall(store.trace(trace_id)))
        return 0
    finally:
        store.close()


def register(sub: Any) -> None:
    trace = sub.add_parser(
        "trace",
        help="draw a request's trace as a waterfall, list the slowest traces, or sum where "
        "the last traces spent their time between spans",
    )
    trace.add_argument("ref", nargs="?", help="a request id (as Predict answers) or a trace id")
    trace.add_argument("--slowest", type=int, metavar="N", help="list the N slowest traces")
    trace.add_argument(
        "--hops",
        type=int,
        metavar="N",
        help="the last N traces cut into hops between span boundaries (a proxy forwarding, "
        "a server taking a call off the wire), each hop's median, p90 and share",
    )
    trace.add_argument(
        "--since",
        default="15m",
        help="with --slowest or --hops: traces started this long ago (15m)",
    )
    add_output(trace, "the spans, the slowest traces or the hops as JSON")
    add_mesh_flags(trace)
    trace.add_argument("--width", type=int, help="output width in columns")
    trace.set_defaults(func=cmd_trace)
