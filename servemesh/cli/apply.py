"""`servemesh apply FILE`: add and remove models, versions and feature views live."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from servemesh.cli.flags import add_gate_overrides
from servemesh.cli.gates import report_gates
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_apply import LiveApply, LiveApplyResult
from servemesh.proxy.live_plan import ApplyPlan
from servemesh.rollout.change_gates import (
    enforce,
    models_deployed,
    overrides_from,
    record_if_overridden,
)
from servemesh.state.paths import ApplyError

# The change column's colour by sign: added, removed, changed.
_STYLE = {"+": "green", "-": "red", "~": "yellow"}


def plan_table(plan: ApplyPlan, title: str) -> Table:
    """Every change of the plan, one row each: the same changes, in the same order, as the
    lines `routes history` records for it."""
    table = Table(title=title, title_justify="left")
    table.add_column("change")
    table.add_column("what")
    table.add_column("detail")
    for change in plan.changes():
        style = _STYLE[change.sign]
        table.add_row(f"[{style}]{change.sign} {change.kind}[/{style}]", change.what, change.detail)
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
    if result.started:
        out.print(f"new pool started, serving and healthy in Envoy: {', '.join(result.started)}")
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
    applier = LiveApply(RouteManager(mesh.paths))
    gates = None
    if not args.dry_run:
        # A freeze or a spent error budget refuses what would deploy (change_gates).
        live, plan = applier.plan(text, str(path), prune=args.prune)
        deployed = models_deployed(plan)
        if deployed:
            gates = enforce(
                live,
                deployed,
                command=f"apply {path}",
                overrides=overrides_from(
                    getattr(args, "override", None), getattr(args, "reason", None)
                ),
            )
            report_gates(gates)
    report(applier.apply(text, str(path), prune=args.prune, dry_run=args.dry_run))
    if gates is not None:
        record_if_overridden(mesh.paths.state_dir, gates)
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
        help="remove models, feature views and versions the file leaves out (kept otherwise)",
    )
    apply.add_argument(
        "--dry-run", action="store_true", help="print the plan (registry checked), change nothing"
    )
    add_gate_overrides(apply)
    apply.set_defaults(func=cmd_apply)
