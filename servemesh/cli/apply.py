"""`servemesh apply FILE`: add and remove models, versions and feature views live."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out
from servemesh.proxy.apply import ApplyError
from servemesh.proxy.live_apply import LiveApply, LiveApplyResult
from servemesh.proxy.live_plan import ApplyPlan, coalescing_text, logs_text


def plan_table(plan: ApplyPlan, title: str) -> Table:
    """What changes: added and removed models, versions, views; weights; fallbacks;
    routing, coalescing and logs."""
    table = Table(title=title, title_justify="left")
    table.add_column("change")
    table.add_column("what")
    table.add_column("detail")
    for model in plan.added_models:
        table.add_row("[green]+ model[/green]", model, "")
    for model in plan.removed_models:
        table.add_row("[red]- model[/red]", model, "--prune")
    for model, version in plan.added_versions:
        table.add_row("[green]+ version[/green]", f"{model} {version}", "")
    for model, version in plan.removed_versions:
        table.add_row("[red]- version[/red]", f"{model} {version}", "")
    for view in plan.added_views:
        table.add_row("[green]+ feature view[/green]", view, "")
    for view in plan.removed_views:
        table.add_row("[red]- feature view[/red]", view, "--prune")
    for model, (before, after) in sorted(plan.weights.items()):
        old = " ".join(f"{v}={w}" for v, w in sorted(before.items())) or "-"
        new = " ".join(f"{v}={w}" for v, w in sorted(after.items()))
        table.add_row("[yellow]~ weights[/yellow]", model, f"{old} -> {new}")
    for model, (old_score, new_score) in sorted(plan.fallback.items()):
        table.add_row("[yellow]~ fallback_score[/yellow]", model, f"{old_score} -> {new_score}")
    if plan.routing_changed:
        table.add_row("[yellow]~ routing[/yellow]", "policy or shadow", "")
    if plan.coalescing is not None:
        old, new = (coalescing_text(c) for c in plan.coalescing)
        table.add_row("[yellow]~ coalescing[/yellow]", "gateways", f"{old} -> {new}")
    if plan.logs is not None:
        old, new = (logs_text(c) for c in plan.logs)
        table.add_row("[yellow]~ logs[/yellow]", "every service", f"{old} -> {new}")
    return table


def report(result: LiveApplyResult) -> None:
    plan = result.plan
    kept = [f"model {m}" for m in plan.kept_models] + [f"view {v}" for v in plan.kept_views]
    if not plan.changed:
        out.print("no change: the running mesh already matches the file")
    elif result.dry_run:
        out.print(plan_table(plan, "plan (dry run: nothing changed)"))
    else:
        out.print(plan_table(plan, "applied"))
    if kept:
        out.print(f"left running (not in the file; --prune removes them): {', '.join(kept)}")
    if result.loads:
        loads = Table(title="new versions loaded and warmed up", title_justify="left")
        loads.add_column("replica")
        loads.add_column("versions")
        loads.add_column("load ms", justify="right")
        for load in result.loads:
            versions = ", ".join(f"{m} {v}" for m, v in load.loaded)
            loads.add_row(load.replica, versions, f"{load.load_ms:.0f}")
        out.print(loads)
    if result.envoy is not None:
        out.print(
            f"applied as change #{result.envoy.entry_id}: Envoy serves config version "
            f"{result.envoy.version} ({result.envoy.confirm_ms:.0f} ms from swap to confirmed)"
        )


def cmd_apply(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    path = Path(args.file)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ApplyError(f"{path}: cannot read: {exc.strerror}") from None
    applier = LiveApply(mesh.routes())
    report(applier.apply(text, str(path), prune=args.prune, dry_run=args.dry_run))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    apply = sub.add_parser(
        "apply",
        help="make the running mesh match a spec file, live: models, versions, feature views, "
        "routing",
    )
    apply.add_argument("file", help="the mesh spec (declared, or a running mesh's resolved one)")
    add_mesh_flags(apply)
    apply.add_argument(
        "--prune",
        action="store_true",
        help="remove models and feature views the file leaves out (kept otherwise)",
    )
    apply.add_argument(
        "--dry-run", action="store_true", help="print the plan (registry checked), change nothing"
    )
    apply.set_defaults(func=cmd_apply)
