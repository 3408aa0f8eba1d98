"""`servemesh chaos run FILE` and `servemesh chaos list`."""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml
from rich.table import Table

from servemesh.cli.flags import add_output
from servemesh.cli.output import console, out, write
from servemesh.contract.errors import UsageError


def _parse_vars(items: list[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--var {item!r}: expected key=value")
        values[key] = yaml.safe_load(text)
    return values


def cmd_chaos_run(args: argparse.Namespace) -> int:
    from servemesh.chaos.runner import run_drill

    result = run_drill(
        args.file,
        spec=args.spec,
        out_dir=args.out,
        variables=_parse_vars(args.var or []),
        console=console,
        live=not args.quiet,
    )
    summary = result.summary
    colour = "green" if result.ok else "red"
    out.print(f"[bold {colour}]{result.verdict.upper()}[/bold {colour}]: {result.text}")
    if summary:
        n = summary["numbers"]
        recover = n["time_to_recover_s"]
        out.print(
            f"sent {n['sent']}, failed {n['failed']}, degraded {n['degraded']}, "
            f"success {n['success_pct']}%, time to recover "
            + (f"{recover} s" if recover is not None else "not recovered")
        )
        out.print(f"report: {summary['files']['report']}")
        out.print(f"journal: {summary['files']['journal']}")
    return 0 if result.ok else 1


def cmd_chaos_list(args: argparse.Namespace) -> int:
    from servemesh.chaos.runner import list_drills

    drills = list_drills()
    if args.json:
        shown = [{"drill": d["name"], "proves": d["proves"], "slo": d["slo"]} for d in drills]
        write(json.dumps(shown))
        return 0
    table = Table(title="drills (servemesh chaos run NAME)", title_justify="left", show_lines=True)
    table.add_column("drill")
    table.add_column("what it proves")
    table.add_column("steady state (SLO)")
    for drill in drills:
        table.add_row(drill["name"], drill["proves"], drill["slo"])
    out.print(table)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    chaos = sub.add_parser("chaos", help="failure drills (Chaos Toolkit experiments)")
    chaos_sub = chaos.add_subparsers(dest="chaos", required=True)
    run = chaos_sub.add_parser(
        "run", help="run a drill against its own mesh; live progress, then a verdict and a report"
    )
    run.add_argument("file", help="a drill file, or a drill name from `servemesh chaos list`")
    run.add_argument("--spec", help="mesh spec to run the drill against (default: the drill's)")
    run.add_argument("--out", help="where the journal and report go (default: chaos-runs/...)")
    run.add_argument(
        "--var",
        action="append",
        metavar="KEY=VALUE",
        help="override a configuration value, e.g. --var fault_s=10 --var rate=50",
    )
    run.add_argument("--quiet", action="store_true", help="no live progress")
    run.set_defaults(func=cmd_chaos_run)
    listing = chaos_sub.add_parser("list", help="the drills and what each proves")
    add_output(listing, "print the drills as JSON")
    listing.set_defaults(func=cmd_chaos_list)
