"""`servemesh routes ...`: what operators use to see and change traffic while it flows."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from servemesh.cli import apply as apply_command
from servemesh.cli.flags import add_gate_overrides, add_output
from servemesh.cli.gates import overridden_reason, report_gates
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import console, out, write
from servemesh.proxy.apply import ApplyResult, RouteManager
from servemesh.proxy.live_view import live_view
from servemesh.proxy.shadow_report import shadow_report
from servemesh.rollout.change_gates import (
    enforce,
    models_rolled_forward,
    overrides_from,
    record_if_overridden,
    weights_deploy,
)
from servemesh.state.paths import ApplyError

_WEIGHT = re.compile(r"^([a-z0-9][a-z0-9_-]{0,62})=(-?\d+)$")


def _manager(args: argparse.Namespace) -> RouteManager:
    return RouteManager(running_mesh(args).paths)


def _report(result: ApplyResult) -> None:
    if not result.diff:
        out.print("no change: Envoy already serves this")
        return
    styles = {"+": "green", "-": "red", "~": "yellow"}
    for line in result.diff:
        style = styles.get(line[:1], "default")
        out.print(f"[{style}]{escape(line)}[/{style}]", highlight=False)
    out.print(
        f"applied as change #{result.entry_id}: Envoy serves config version {result.version} "
        f"({result.confirm_ms:.0f} ms from swap to confirmed)"
    )


def _shown(address: str) -> str:
    """An admin address as the operator's shell would name it: a socket under the current
    folder by its relative path (`unix:.servemesh/admin/envoy.sock`), others as they are."""
    scheme, sep, path = address.partition(":")
    if scheme != "unix" or not sep:
        return address
    try:
        return f"unix:{Path(path).relative_to(Path.cwd())}"
    except ValueError:
        return address


def cmd_show(args: argparse.Namespace) -> int:
    manager = _manager(args)
    spec = manager.live_spec()
    rows = live_view(manager.admins(spec), spec)
    if args.json:
        write(json.dumps([vars(r) for r in rows]))
        return 0
    where = ", ".join(_shown(a.address) for a in manager.admins(spec).values())
    table = Table(title=f"what Envoy serves ({where})", title_justify="left")
    for column in (
        "model",
        "version",
        "weight",
        "buckets",
        "healthy per zone",
        "requests",
        "errors",
        "retries",
        "retried ok",
        "per-try timeout",
        "ejections",
        "overflows",
    ):
        table.add_column(
            column,
            justify="left" if column in ("model", "version", "healthy per zone") else "right",
        )
    for row in rows:
        health = "  ".join(f"{z} {row.healthy.get(z, 0)}/{n}" for z, n in sorted(row.hosts.items()))
        version = row.version + (" (shadow)" if row.shadow else "")
        table.add_row(
            row.model,
            version,
            f"{row.weight}%",
            f"{row.buckets[0]}-{row.buckets[1] - 1}" if row.buckets else "-",
            health,
            str(row.requests),
            str(row.errors),
            str(row.retries),
            str(row.retry_successes),
            (f"{row.per_try_timeout_ms} ms" if row.per_try_timeout_ms else "none")
            + (", hedged" if row.hedging else ""),
            str(row.ejections),
            str(row.overflows),
        )
    out.print(table)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    weights: dict[str, int] = {}
    for text in args.weights:
        match = _WEIGHT.match(text)
        if not match:
            raise ApplyError(f"{text!r}: expected VERSION=WEIGHT, e.g. v1=90")
        weights[match.group(1)] = int(match.group(2))
    manager = _manager(args)
    live = manager.live_spec()
    before = dict(live.models[args.model].traffic) if args.model in live.models else {}
    after = {version: weights.get(version, 0) for version in before} or weights
    overrides = overrides_from(args.override, args.reason)
    # Only a move toward anything but the version serving the most is a deploy (the way
    # back is never refused: change_gates.weights_deploy).
    models = [args.model] if weights_deploy(before, after) else []
    gates = enforce(live, models, command=f"routes set {args.model}", overrides=overrides)
    report_gates(gates)
    _report(manager.set_weights(args.model, weights, reason=overridden_reason(gates)))
    record_if_overridden(manager.paths.state_dir, gates)
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    """`routes apply FILE` is `servemesh apply FILE` now: a routing-only change is a mesh
    file whose models and views are the running ones (docs/cli.md, "Changes")."""
    console.print(f"note: `servemesh routes apply` is now `servemesh apply {args.file}`")
    return apply_command.cmd_apply(args)


def cmd_history(args: argparse.Namespace) -> int:
    history = _manager(args).history()
    if args.json:
        write(json.dumps(history))
        return 0
    table = Table(title="applied route changes", title_justify="left")
    for column in ("#", "when", "who", "action", "status", "ms", "change"):
        table.add_column(column)
    for entry in history:
        status = entry.get("status", "applied")
        if entry.get("error"):
            status += f": {entry['error']}"
        table.add_row(
            str(entry["id"]),
            str(entry.get("when", "")),
            str(entry.get("who", "")),
            str(entry.get("action", "")),
            status,
            str(entry.get("apply_ms")),
            "\n".join(entry.get("diff", [])),
        )
    out.print(table)
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    manager = _manager(args)
    live, target, action = manager.rollback_plan(args.entry)
    # Back toward the version serving the most is never refused; a rollback that undoes
    # a way back (or returns to a later change) deploys, and the gates judge it.
    models = models_rolled_forward(live, target)
    gates = enforce(
        live,
        models,
        command=f"routes {action}",
        overrides=overrides_from(args.override, args.reason),
    )
    report_gates(gates)
    _report(manager.rollback(args.entry))
    record_if_overridden(manager.paths.state_dir, gates)
    return 0


def cmd_shadow(args: argparse.Namespace) -> int:
    manager = _manager(args)
    if args.off:
        _report(manager.set_shadow(args.model, None))
    elif not args.version:
        raise ApplyError("name the version to mirror to, or --off")
    else:
        # A shadow started or moved is a deploy of its version, as in `apply`.
        gates = enforce(
            manager.live_spec(),
            [args.model],
            command=f"routes shadow {args.model}",
            overrides=overrides_from(args.override, args.reason),
        )
        report_gates(gates)
        _report(manager.set_shadow(args.model, args.version, args.percent))
        record_if_overridden(manager.paths.state_dir, gates)
    return 0


def cmd_shadow_report(args: argparse.Namespace) -> int:
    manager = _manager(args)
    report = shadow_report(manager.paths.state_dir / "shadow", args.model, args.tolerance)
    if args.json:
        write(json.dumps({**vars(report), "agreement": report.agreement}))
        return 0
    out.print(f"shadow comparison for {report.model} (tolerance {report.tolerance:g})")
    out.print(
        f"  pairs {report.pairs}: scores agree in {report.agreeing} ({report.agreement:.1%}), "
        f"mean worst difference {report.mean_abs_diff:.5f}"
    )
    out.print(
        f"  primary versions {report.primary_versions}, shadow versions {report.shadow_versions}"
    )
    out.print(
        f"  latency p50/p99: primary {report.primary_p50_ms:.2f}/{report.primary_p99_ms:.2f} ms, "
        f"shadow {report.shadow_p50_ms:.2f}/{report.shadow_p99_ms:.2f} ms"
    )
    out.print(
        f"  unpaired: {report.primary_only} primary only, {report.shadow_only} shadow only; "
        f"shadow errors {report.shadow_errors}"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    routes = sub.add_parser("routes", help="see and change what Envoy serves, live")
    add_mesh_flags(routes)
    verbs = routes.add_subparsers(dest="verb", required=True)

    show = verbs.add_parser("show", help="per model version: weight, healthy hosts, counters")
    add_mesh_flags(show, inherited=True)
    add_output(show)
    show.set_defaults(func=cmd_show)

    set_ = verbs.add_parser(
        "set", help="set a model's weights, e.g. `routes set fraud v1=90 v2=10`"
    )
    add_mesh_flags(set_, inherited=True)
    set_.add_argument("model")
    set_.add_argument("weights", nargs="+", metavar="VERSION=WEIGHT")
    add_gate_overrides(set_)
    set_.set_defaults(func=cmd_set)

    apply = verbs.add_parser("apply", help="the same as `servemesh apply FILE` (kept as an alias)")
    add_mesh_flags(apply, inherited=True)
    apply.add_argument("file")
    add_gate_overrides(apply)
    apply.set_defaults(prune=False, dry_run=False)
    apply.set_defaults(func=cmd_apply)

    history = verbs.add_parser("history", help="every applied change: who, when, what")
    add_mesh_flags(history, inherited=True)
    add_output(history)
    history.set_defaults(func=cmd_history)

    rollback = verbs.add_parser("rollback", help="undo the last change, or return to change N")
    add_mesh_flags(rollback, inherited=True)
    rollback.add_argument("entry", nargs="?", type=int)
    add_gate_overrides(rollback)
    rollback.set_defaults(func=cmd_rollback)

    shadow = verbs.add_parser("shadow", help="mirror a model's traffic to a version (or --off)")
    add_mesh_flags(shadow, inherited=True)
    shadow.add_argument("model")
    shadow.add_argument("version", nargs="?")
    shadow.add_argument("--percent", type=float, default=100.0)
    shadow.add_argument("--off", action="store_true")
    add_gate_overrides(shadow)
    shadow.set_defaults(func=cmd_shadow)

    report = verbs.add_parser("shadow-report", help="compare a shadow version with the primary")
    add_mesh_flags(report, inherited=True)
    report.add_argument("model")
    report.add_argument(
        "--tolerance", type=float, default=1e-3, help="max score difference to agree"
    )
    add_output(report)
    report.set_defaults(func=cmd_shadow_report)
