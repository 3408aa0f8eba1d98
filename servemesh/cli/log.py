"""`servemesh log query ...` and `servemesh log status`: the prediction log from a shell."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.table import Table

from servemesh.cli.flags import add_output
from servemesh.cli.mesh import add_mesh_flags, recorded_state_dir
from servemesh.cli.output import out
from servemesh.contract.errors import ServemeshError, UsageError
from servemesh.spec import MeshSpec, load_resolved, load_spec
from servemesh.state.paths import MeshPaths


def _spec_and_state(args: argparse.Namespace) -> tuple[MeshSpec, Path]:
    spec = load_spec(args.spec)
    # A stopped mesh's log stays readable (its Parquet files); a PostgreSQL log is read
    # with the spec that names it. With neither a mesh nor its log: no running mesh.
    if spec.prediction_log.dsn() is not None and args.spec is not None:
        state_dir = Path(args.state_dir or spec.state_dir)
    else:
        state_dir = recorded_state_dir(args, "predictions")
    # A running mesh's resolved spec is the one its gateways write with.
    running = MeshPaths(state_dir).resolved_spec
    if args.spec is None and running.is_file():
        spec = load_resolved(running)
    return spec, state_dir


def cmd_query(args: argparse.Namespace) -> int:
    from servemesh.predlog.query import (
        LogQuery,
        parse_entity,
        parse_since,
        parse_slowest,
        reader_for,
    )

    try:
        share, count = parse_slowest(args.slowest) if args.slowest else (None, None)
        query = LogQuery(
            since_s=parse_since(args.since),
            slowest_share=share,
            slowest_count=count,
            entities=tuple(parse_entity(e) for e in args.entity or ()),
            errors=args.errors,
            degraded=args.degraded,
            tier=args.tier,
            model=args.model,
            version=args.version,
            request_id=args.request_id,
            trace_id=args.trace_id,
            limit=args.limit,
        )
        if args.version and not args.model:
            raise ValueError("--version: give --model too")
        if args.limit < 1:
            raise ValueError("--limit: give 1 or more")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    spec, state_dir = _spec_and_state(args)
    try:
        reader = reader_for(spec.prediction_log, state_dir)
        retention_s = spec.prediction_log.retention_s
        reader.expire(retention_s)
        # Files are deleted whole, once their newest record is past the retention: the
        # query itself never reaches further back than the retention.
        result = reader.query(replace(query, since_s=min(query.since_s, retention_s)))
    except Exception as exc:  # the store: a database down, a file being replaced
        raise ServemeshError(f"the prediction log could not be read: {exc}") from None
    if args.json:
        for row in result.rows:
            out.print(json.dumps(row, default=_jsonable), markup=False)
        return 0
    out.print(_table(result.rows))
    what = f"{result.matched} matching calls in the last {args.since}"
    if result.selected != result.matched:
        what += f", {result.selected} selected by --slowest {args.slowest}"
    if len(result.rows) < result.selected:
        what += f"; showing {len(result.rows)} (--limit)"
    out.print(what)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from servemesh.predlog.query import gateway_status, reader_for

    spec, state_dir = _spec_and_state(args)
    try:
        reader = reader_for(spec.prediction_log, state_dir)
        summary = reader.summary()
    except Exception as exc:
        raise ServemeshError(f"the prediction log could not be read: {exc}") from None
    gateways = gateway_status(state_dir)
    if args.json:
        report = {
            "store": summary.store,
            "files": summary.files,
            "rows": summary.rows,
            "oldest": summary.oldest,
            "newest": summary.newest,
            "retention": spec.prediction_log.retention,
            "gateways": gateways,
        }
        out.print(json.dumps(report, default=_jsonable), markup=False)
        return 0
    out.print(
        f"store:     {summary.store}" + ("" if spec.prediction_log.enabled else " (disabled)")
    )
    if summary.files is not None:
        out.print(f"files:     {summary.files}")
    out.print(f"records:   {summary.rows}")
    out.print(f"oldest:    {_time(summary.oldest)}")
    out.print(f"newest:    {_time(summary.newest)}")
    out.print(f"retention: {spec.prediction_log.retention}")
    table = Table(title="gateways (counters since each one started)", title_justify="left")
    for column in ("gateway", "zone", "accepted", "written", "dropped", "write errors"):
        table.add_column(column, justify="left" if column in ("gateway", "zone") else "right")
    table.add_column("buffered", justify="right")
    table.add_column("updated")
    for g in gateways:
        table.add_row(
            str(g.get("gateway", "")),
            str(g.get("zone", "")),
            *(str(g.get(k, "")) for k in ("accepted", "written", "dropped", "write_errors")),
            str(g.get("buffered", "")),
            _time(datetime.fromtimestamp(float(g.get("updated", 0)), UTC)),
        )
    out.print(table)
    return 0


def _time(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table(show_lines=False)
    for column in ("time (UTC)", "request id", "model/version", "replica/zone"):
        table.add_column(column, no_wrap=True)
    for column in ("total ms", "feature ms", "infer ms"):
        table.add_column(column, justify="right")
    table.add_column("status")
    table.add_column("degraded")
    table.add_column("tier")
    table.add_column("entities")
    # Errors say why: their message, when the rows hold any.
    with_message = any(row["status"] != "OK" for row in rows)
    if with_message:
        table.add_column("message", overflow="ellipsis", max_width=60)
    for row in rows:
        entities = ", ".join(row["entity_keys"][:4]) + (
            f" (+{len(row['entity_keys']) - 4})" if len(row["entity_keys"]) > 4 else ""
        )
        replica = f"{row['replica']}/{row['zone']}" if row["replica"] else "-"
        status = row["status"] if row["status"] == "OK" else f"[red]{row['status']}[/red]"
        table.add_row(
            _time(row["ts"])[11:],
            row["request_id"],
            f"{row['model']}/{row['version'] or '-'}",
            replica,
            _ms(row["total_ms"]),
            _ms(row["feature_ms"]),
            _ms(row["inference_ms"]),
            status,
            "yes" if row["degraded"] else "",
            row["tier"] or "-",
            entities,
            *([row["message"] or row["degraded_reason"]] if with_message else []),
        )
    return table


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return _time(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def register(sub: Any) -> None:
    log = sub.add_parser("log", help="the prediction log: query it, see its state")
    log_sub = log.add_subparsers(dest="log_command", required=True)

    def common(parser: argparse.ArgumentParser) -> None:
        add_mesh_flags(parser)
        add_output(parser, "JSON (query: one call a line)")

    query = log_sub.add_parser("query", help="calls of the last hour (or --since), newest first")
    query.add_argument("--since", default="1h", help="how far back: 5m, 1h, 1d (default 1h)")
    query.add_argument("--slowest", help="the slowest share (1%%) or number (20) of the calls")
    query.add_argument(
        "--entity", action="append", metavar="NAME=ID", help="calls naming this entity id"
    )
    query.add_argument("--errors", action="store_true", help="calls answered with a non-OK status")
    query.add_argument(
        "--degraded", action="store_true", help="calls answered degraded (fallback, stale features)"
    )
    query.add_argument(
        "--tier",
        choices=("online", "cache", "precomputed"),
        help="calls answered by this tier (a model's tiers: docs/tiers.md)",
    )
    query.add_argument("--model")
    query.add_argument("--version")
    query.add_argument("--request-id")
    query.add_argument("--trace-id", help="the trace id of the caller's traceparent")
    query.add_argument("--limit", type=int, default=50, help="rows shown (default 50)")
    common(query)
    query.set_defaults(func=cmd_query)

    status = log_sub.add_parser("status", help="the store, its records, each gateway's drops")
    common(status)
    status.set_defaults(func=cmd_status)
