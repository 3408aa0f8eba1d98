"""`servemesh stream consume|status|send`: streaming predictions from a Redis stream.

servemesh stream status                         # lag and throughput of every spec'd stream
servemesh stream send --name payments --entity user-42 --count 100
servemesh stream consume --name payments        # a consumer in the foreground (`up` starts one)

A stream is an entry of the spec's `streams:`; each event (XADD <input> * entity <id>
[features <json>]) gets one prediction on the output stream, or a dead letter with its
reason (servemesh/streams/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from servemesh.cli.flags import add_output
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import console, out, write
from servemesh.contract.errors import ServemeshError, UsageError


class StreamError(ServemeshError):
    """A stream command that cannot do what it was asked (the stream's Redis, its name)."""


def cmd_consume(args: argparse.Namespace) -> int:
    from servemesh.streams.process import consume

    mesh = running_mesh(args)
    mesh.spec.stream(args.name)  # a SpecError naming the known ones
    console.print(f"consuming stream {args.name} (SIGTERM or Ctrl-C stops it after its batch)")
    asyncio.run(consume(mesh.spec, args.name, consumer=args.consumer, metrics_port=None))
    return 0


def _age(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def cmd_status(args: argparse.Namespace) -> int:
    import redis
    from rich.table import Table

    from servemesh.streams.status import stream_status

    mesh = running_mesh(args)
    streams = [mesh.spec.stream(args.name)] if args.name else list(mesh.spec.streams)
    if not streams:
        console.print("no streams in the running mesh's spec (add them under `streams:`)")
        return 0

    async def gather() -> list[Any]:
        return [await stream_status(mesh.spec, s) for s in streams]

    try:
        found = asyncio.run(gather())
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise StreamError(f"the streams' Redis does not answer: {exc}") from None
    if args.json:
        write(json.dumps([s.as_dict() for s in found], indent=2))
        return 0
    table = Table(title="streams", title_justify="left")
    for column in (
        "stream",
        "model",
        "consumer",
        "events/s",
        "pending",
        "oldest pending",
        "undelivered",
        "predicted",
        "dead letters",
        "retries",
        "in / out",
    ):
        table.add_column(column, justify="left" if column in ("stream", "model") else "right")
    for s in found:
        stats, lag = s.stats, s.lag
        running = s.consumer_running
        who = stats.get("consumer", "-") + ("" if running else " (stopped)")
        table.add_row(
            s.name,
            f"{s.model} ({s.mode})",
            who if stats else "none yet",
            stats.get("events_per_second", "0") if running else "0",
            str(lag.pending) if lag else "-",
            _age(lag.oldest_pending_age_s) if lag and lag.pending else "-",
            str(lag.undelivered) if lag and lag.undelivered is not None else "-",
            stats.get("predicted", "0"),
            str(lag.dead_letters) if lag else "0",
            stats.get("retries", "0"),
            f"{lag.length} / {lag.output_length}" if lag else "-",
        )
    out.print(table)
    return 0


def cmd_send(args: argparse.Namespace) -> int:
    """A few events by hand (for trying a stream out; producers XADD themselves)."""
    from servemesh.streams.consumer import stream_client
    from servemesh.streams.keys import StreamKeys

    mesh = running_mesh(args)
    stream = mesh.spec.stream(args.name)
    if args.count < 1 or args.count > 1_000_000:
        raise UsageError("--count: 1 to 1000000")
    fields: dict[Any, Any] = {"entity": args.entity}
    if args.features:
        fields["features"] = args.features

    async def send() -> list[str]:
        client = stream_client(mesh.spec, stream)
        try:
            async with client.pipeline(transaction=False) as pipe:
                for _ in range(args.count):
                    pipe.xadd(StreamKeys.of(stream).input, dict(fields))
                return [i.decode() for i in await pipe.execute()]
        finally:
            await client.aclose()

    ids = asyncio.run(send())
    shown = ids[0] if len(ids) == 1 else f"{ids[0]} .. {ids[-1]}"
    out.print(f"sent {len(ids)} event(s) to {StreamKeys.of(stream).input}: {shown}", markup=False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    stream = sub.add_parser(
        "stream", help="streaming predictions: consume a Redis stream, its lag and throughput"
    )
    add_mesh_flags(stream)
    stream_sub = stream.add_subparsers(dest="stream_command", required=True)
    consume = stream_sub.add_parser(
        "consume", help="run a stream's consumer in the foreground (stops on SIGTERM)"
    )
    consume.add_argument("--name", required=True, help="the stream (streams[].name)")
    consume.add_argument("--consumer", help="its name in the group (default: <stream>-0)")
    add_mesh_flags(consume, inherited=True)
    consume.set_defaults(func=cmd_consume, error_label="stream consume")
    status = stream_sub.add_parser(
        "status", help="lag (pending, oldest pending, undelivered) and throughput per stream"
    )
    status.add_argument("--name", help="one stream (default: every one)")
    add_output(status, "print as JSON")
    add_mesh_flags(status, inherited=True)
    status.set_defaults(func=cmd_status, error_label="stream status")
    send = stream_sub.add_parser("send", help="add events to a stream's input (to try it)")
    send.add_argument("--name", required=True, help="the stream")
    send.add_argument("--entity", required=True, help="an id, or name=id[,name=id]")
    send.add_argument("--features", help="JSON feature values written to the view first")
    send.add_argument("--count", type=int, default=1, help="how many such events")
    add_mesh_flags(send, inherited=True)
    send.set_defaults(func=cmd_send, error_label="stream send")
