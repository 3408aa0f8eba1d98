"""`servemesh scale status|history|forecast|run`: the scaler's view of each pool (each model
pool's servers, gateways, feature services) in each zone, what it decided and why, the model
servers' forecast, and the scaler itself in the foreground (docs/capacity.md)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from servemesh.cli.flags import add_duration, add_output, deprecated
from servemesh.cli.mesh import add_mesh_flags, recorded_state_dir, running_mesh
from servemesh.cli.output import out, write


def cmd_status(args: argparse.Namespace) -> int:
    from servemesh.scaling.actuator import busy_with_an_update, zone_replicas
    from servemesh.scaling.history import pool_status, read_status
    from servemesh.spec import scaled_pool_label

    mesh = running_mesh(args)
    spec = mesh.spec
    found = read_status(mesh.state_dir)
    rows = []
    for kind, pool_name in spec.scaled_pools():
        pool = spec.scaling.pool(kind)
        label = scaled_pool_label(kind, pool_name)
        zones = pool_status(found, label)
        for zone in spec.scaled_zones(kind, pool_name):
            rotation, standby = zone_replicas(spec, zone, kind, pool_name)
            last = zones.get(zone, {})
            rows.append(
                {
                    "pool": label,
                    "zone": zone,
                    "in_rotation": len(rotation),
                    "standby": len(standby),
                    "min": pool.min,
                    "max": pool.max,
                    "floor": last.get("floor"),
                    "signals": last.get("signals", {}),
                    "decision": last.get("decision", ""),
                }
            )
    held = busy_with_an_update(spec) or str((found or {}).get("held") or "")
    if not spec.scaling.enabled:
        held = "scaling.enabled is false"
    at = (found or {}).get("at")
    host = (found or {}).get("host") or {}
    edges = (found or {}).get("edges") or {}
    if args.json:
        write(json.dumps({"at": at, "held": held, "pools": rows, "host": host, "edges": edges}))
        return 0
    table = Table(title=f"replicas per pool and zone (last round {at or '-'})")
    for column in ("pool", "zone", "in rotation", "standby", "min..max", "floor"):
        table.add_column(column)
    signals_shown = ("p99_ms", "queue_depth", "in_flight", "cpu", "calls_per_s")
    for column in ("p99 ms", "queue", "in flight", "cpu", "calls/s"):
        table.add_column(column, justify="right")
    table.add_column("last decision")
    for row in rows:
        signals = row["signals"]
        table.add_row(
            row["pool"],
            row["zone"],
            str(row["in_rotation"]),
            str(row["standby"]),
            f"{row['min']}..{row['max']}",
            "-" if row["floor"] is None else str(row["floor"]),
            *(_shown(signals.get(k)) for k in signals_shown),
            row["decision"] or "-",
        )
    out.print(table)
    if edges:
        shown = Table(title="Predict at each zone's edge, against the objective")
        for column in ("zone", "p99 ms", "objective", "errors", "calls/s", "breach", "blamed"):
            shown.add_column(column)
        for zone, edge in sorted(edges.items()):
            shown.add_row(
                zone,
                _shown(edge.get("p99_ms")),
                f"{_shown(edge.get('objective_p99_ms'))} ms, "
                f"{_shown(edge.get('objective_error_ratio'))} errors",
                _shown(edge.get("error_ratio")),
                _shown(edge.get("calls_per_s")),
                str(edge.get("breach") or "-"),
                str(edge.get("blamed") or "-"),
            )
        out.print(shown)
    if host.get("busy") is not None:
        verdict = "no headroom" if host.get("saturated") else "headroom"
        out.print(
            f"host: {verdict}: CPU {host['busy']:.0%} busy, run queue {host.get('runnable')} "
            f"on {host.get('cores')} cores, {host.get('headroom_cores')} cores idle",
            markup=False,
        )
    if held:
        out.print(f"held: {held}", markup=False)
    return 0


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def cmd_history(args: argparse.Namespace) -> int:
    from servemesh.scaling.history import FOLDER, read_history

    state_dir = recorded_state_dir(args, FOLDER)
    entries = read_history(state_dir, args.limit)
    if args.json:
        for entry in entries:
            write(json.dumps(entry))
        return 0
    if not entries:
        out.print("no scaling decision recorded yet")
        return 0
    table = Table()
    for column in ("at (UTC)", "pool", "zone", "change", "why", "outcome", "s"):
        table.add_column(column)
    for entry in entries:
        table.add_row(
            str(entry["at"]),
            str(entry.get("pool", "model")),
            str(entry["zone"]),
            f"{entry['from']} -> {entry['to']}",
            str(entry["reason"]),
            str(entry["outcome"]),
            "-" if entry.get("seconds") is None else f"{entry['seconds']:.1f}",
        )
    out.print(table)
    return 0


def cmd_forecast(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime, timedelta
    from zoneinfo import ZoneInfo

    from servemesh.scaling.forecast import forecast, replica_capacity
    from servemesh.scaling.loop import logged_hours

    mesh = running_mesh(args)
    spec = mesh.spec
    pool = spec.scaling.model_servers
    zone = ZoneInfo(pool.schedule.timezone)
    zones = len(spec.scaled_zones())
    capacity, source = replica_capacity(spec, mesh.state_dir)
    hours = max(0, round(args.span / 3600.0))
    history = logged_hours(spec, pool.forecast.weeks * 7 * 86400.0 + hours * 3600.0)
    actual = {at: calls / 3600.0 for at, calls in history}
    now = datetime.now(UTC)
    this_hour = now.replace(minute=0, second=0, microsecond=0)
    rows: list[dict[str, Any]] = []
    for offset in range(-hours, hours + 1):
        at = this_hour + timedelta(hours=offset)
        # A past hour is forecast as it would have been an hour before it began.
        seen_from = min(now, at) if offset > 0 else at - timedelta(hours=1)
        expected = forecast(history, at, seen_from, zone)
        rows.append(
            {
                "hour": at.isoformat(),
                "local": at.astimezone(zone).strftime("%a %H:%M"),
                "profile_rps": round(expected.profile_rps, 2),
                "trend": round(expected.trend, 3),
                "forecast_rps": round(expected.rps, 2),
                "actual_rps": None if offset >= 0 else round(actual.get(at, 0.0), 2),
                "replicas_per_zone": expected.replicas(zones, capacity),
            }
        )
    if args.json:
        write(json.dumps(rows))
        return 0
    table = Table(
        title=f"calls per second by hour ({pool.schedule.timezone}), "
        f"{capacity:g} per replica ({source}) over {zones} zone(s)"
        + (
            ""
            if pool.forecast.enabled
            else "; forecast floors are off (scaling.model_servers.forecast)"
        )
    )
    for column in ("hour", "profile", "trend", "forecast", "actual", "replicas/zone"):
        table.add_column(column, justify="right" if column != "hour" else "left")
    for row in rows:
        table.add_row(
            str(row["local"]),
            f"{row['profile_rps']:g}",
            f"{row['trend']:g}",
            f"{row['forecast_rps']:g}",
            "-" if row["actual_rps"] is None else f"{row['actual_rps']:g}",
            str(row["replicas_per_zone"]),
        )
    out.print(table)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from servemesh.contract.errors import ServemeshError
    from servemesh.scaling.__main__ import run
    from servemesh.scaling.actuator import busy_with_an_update

    mesh = running_mesh(args)
    if mesh.spec.discovery.backend == "dns":
        raise ServemeshError(busy_with_an_update(mesh.spec))
    args.interrupted = "the scaler stopped; the mesh keeps the sizes it confirmed"
    return run(mesh.state_dir)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    scale = sub.add_parser(
        "scale", help="capacity that follows the traffic: the scaler's view and its decisions"
    )
    add_mesh_flags(scale)
    verbs = scale.add_subparsers(dest="verb", required=True)
    status = verbs.add_parser(
        "status",
        help="each pool's replicas per zone (model servers, gateways, feature services), "
        "the last signals and decision",
    )
    add_mesh_flags(status, inherited=True)
    add_output(status)
    status.set_defaults(func=cmd_status)
    history = verbs.add_parser(
        "history", help="every scaling decision with its inputs, oldest first"
    )
    add_mesh_flags(history, inherited=True)
    history.add_argument("--limit", type=int, default=50, help="the last N (default 50)")
    add_output(history, "one JSON record a line")
    history.set_defaults(func=cmd_history)
    fc = verbs.add_parser(
        "forecast",
        help="the request rate the forecast expects by hour, beside the actual, and the "
        "replicas per zone it asks for",
    )
    add_mesh_flags(fc, inherited=True)
    add_duration(
        fc,
        "--span",
        "how far before and after now, in whole hours (default 12h)",
        dest="span",
        default=12 * 3600.0,
    )
    deprecated(fc, "--hours", "--span", dest="span", convert=lambda text: int(text) * 3600.0)
    add_output(fc)
    fc.set_defaults(func=cmd_forecast)
    run = verbs.add_parser(
        "run",
        help="run the scaler in the foreground (`servemesh up --no-scaler`, or a mesh "
        "started elsewhere) until Ctrl-C",
    )
    add_mesh_flags(run, inherited=True)
    run.set_defaults(func=cmd_run)
