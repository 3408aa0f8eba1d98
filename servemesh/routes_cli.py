"""`servemesh routes ...`: what operators use to see and change traffic while it flows."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from servemesh.proxy.admin import AdminError
from servemesh.proxy.apply import ApplyError, ApplyResult, MeshPaths, RouteManager
from servemesh.proxy.live_view import live_view
from servemesh.proxy.shadow_report import shadow_report

# Off a terminal (pipes, logs, tests) rich would wrap at 80 columns: keep lines whole.
console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
_WEIGHT = re.compile(r"^([a-z0-9][a-z0-9_-]{0,62})=(-?\d+)$")


def _manager(args: argparse.Namespace) -> RouteManager:
    return RouteManager(MeshPaths.of(args.state_dir))


def _report(result: ApplyResult) -> None:
    if not result.diff:
        out.print("no change: Envoy already serves this")
        return
    for line in result.diff:
        style = "green" if line.startswith("+") else "red"
        out.print(f"[{style}]{line}[/{style}]", highlight=False)
    out.print(
        f"applied as change #{result.entry_id}: Envoy serves config version {result.version} "
        f"({result.confirm_ms:.0f} ms from swap to confirmed)"
    )


def cmd_show(args: argparse.Namespace) -> int:
    manager = _manager(args)
    spec = manager.live_spec()
    rows = live_view(manager.admin, spec)
    if args.json:
        print(json.dumps([vars(r) for r in rows]))
        return 0
    table = Table(title=f"what Envoy serves ({manager.admin.address})", title_justify="left")
    for column in (
        "model",
        "version",
        "weight",
        "buckets",
        "healthy per zone",
        "requests",
        "errors",
        "retries",
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
    _report(_manager(args).set_weights(args.model, weights))
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ApplyError(f"{path}: cannot read: {exc.strerror}") from None
    _report(_manager(args).apply_spec_text(text, str(path)))
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    history = _manager(args).history()
    if args.json:
        print(json.dumps(history))
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
    _report(_manager(args).rollback(args.entry))
    return 0


def cmd_shadow(args: argparse.Namespace) -> int:
    manager = _manager(args)
    if args.off:
        _report(manager.set_shadow(args.model, None))
    elif not args.version:
        raise ApplyError("name the version to mirror to, or --off")
    else:
        _report(manager.set_shadow(args.model, args.version, args.percent))
    return 0


def cmd_shadow_report(args: argparse.Namespace) -> int:
    manager = _manager(args)
    report = shadow_report(manager.paths.state_dir / "shadow", args.model, args.tolerance)
    if args.json:
        print(json.dumps({**vars(report), "agreement": report.agreement}))
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


def _run(func):  # type: ignore[no-untyped-def]
    """Turn refused changes and an unreachable Envoy into a message and exit status 1."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except (ApplyError, AdminError) as exc:
            console.print(f"[red]refused:[/red] {exc}", highlight=False)
            return 1

    return wrapped


def add_routes_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    routes = sub.add_parser("routes", help="see and change what Envoy serves, live")
    routes.add_argument("--state-dir", help="state dir of the running mesh (default: the spec's)")
    verbs = routes.add_subparsers(dest="verb", required=True)

    show = verbs.add_parser("show", help="per model version: weight, healthy hosts, counters")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_run(cmd_show))

    set_ = verbs.add_parser(
        "set", help="set a model's weights, e.g. `routes set fraud v1=90 v2=10`"
    )
    set_.add_argument("model")
    set_.add_argument("weights", nargs="+", metavar="VERSION=WEIGHT")
    set_.set_defaults(func=_run(cmd_set))

    apply = verbs.add_parser("apply", help="apply the routing and policy of a spec file")
    apply.add_argument("file")
    apply.set_defaults(func=_run(cmd_apply))

    history = verbs.add_parser("history", help="every applied change: who, when, what")
    history.add_argument("--json", action="store_true")
    history.set_defaults(func=_run(cmd_history))

    rollback = verbs.add_parser("rollback", help="undo the last change, or return to change N")
    rollback.add_argument("entry", nargs="?", type=int)
    rollback.set_defaults(func=_run(cmd_rollback))

    shadow = verbs.add_parser("shadow", help="mirror a model's traffic to a version (or --off)")
    shadow.add_argument("model")
    shadow.add_argument("version", nargs="?")
    shadow.add_argument("--percent", type=float, default=100.0)
    shadow.add_argument("--off", action="store_true")
    shadow.set_defaults(func=_run(cmd_shadow))

    report = verbs.add_parser("shadow-report", help="compare a shadow version with the primary")
    report.add_argument("model")
    report.add_argument(
        "--tolerance", type=float, default=1e-3, help="max score difference to agree"
    )
    report.add_argument("--json", action="store_true")
    report.set_defaults(func=_run(cmd_shadow_report))
