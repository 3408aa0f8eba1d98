"""`servemesh fleet ...`: the model-server sets of a running mesh, and the explicit steps
that end a blue-green update (docs/rollouts-fleet.md)."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out
from servemesh.proxy.admin import AdminError
from servemesh.proxy.apply import RouteManager
from servemesh.rollout.fleet import (
    discard_new_set,
    envoy_hosts,
    fleet_status,
    retire_old_set,
)


def _manager(args: argparse.Namespace) -> RouteManager:
    return running_mesh(args).routes()


def fleet_rows(manager: RouteManager) -> list[dict[str, object]]:
    """One row per model server: its set, zone, PID and generation (as the mesh started
    it), whether it drains, what it serves, and in how many clusters Envoy counts it
    healthy."""
    spec = manager.live_spec()
    status = fleet_status(manager.paths.state_dir)
    try:
        hosts = envoy_hosts(manager)
    except (AdminError, OSError, ValueError):
        hosts = {}
    rows: list[dict[str, object]] = []
    first = spec.fleet.sets[0]
    for replica_set in spec.fleet.sets:
        if replica_set is first:
            serves = "every other version" if len(spec.fleet.sets) > 1 else "every version"
        else:
            serves = ", ".join(f"{m} {' '.join(v)}" for m, v in sorted(replica_set.serves.items()))
        for inst in spec.set_replicas(replica_set.name):
            address = f"{spec.host_of(inst.name)}:{spec.port_of(inst.name)}"
            listed = [h[address] for h in hosts.values() if address in h]
            rows.append(
                {
                    "set": replica_set.name or "first",
                    "replica": inst.name,
                    "zone": inst.zone,
                    "pid": status.get(inst.name, {}).get("pid"),
                    "generation": spec.fleet.generations.get(inst.name, 0),
                    "draining": inst.name in spec.fleet.draining,
                    "serves": serves or "-",
                    "healthy_in_clusters": f"{sum(h.healthy for h in listed)}/{len(listed)}",
                }
            )
    return rows


def cmd_show(args: argparse.Namespace) -> int:
    rows = fleet_rows(_manager(args))
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table(title="model servers", title_justify="left")
    for column in ("set", "replica", "zone", "pid", "gen", "draining", "serves", "healthy"):
        table.add_column(column, justify="right" if column in ("pid", "gen") else "left")
    for row in rows:
        table.add_row(
            str(row["set"]),
            str(row["replica"]),
            str(row["zone"]),
            str(row["pid"] or "-"),
            str(row["generation"]),
            "yes" if row["draining"] else "",
            str(row["serves"]),
            str(row["healthy_in_clusters"]),
        )
    out.print(table)
    return 0


def cmd_retire(args: argparse.Namespace) -> int:
    retire_old_set(_manager(args), say=lambda line: out.print(line, highlight=False))
    return 0


def cmd_discard(args: argparse.Namespace) -> int:
    discard_new_set(_manager(args), say=lambda line: out.print(line, highlight=False))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fleet = sub.add_parser(
        "fleet", help="the model-server sets (blue-green, rolling updates) of the running mesh"
    )
    add_mesh_flags(fleet)
    verbs = fleet.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", help="every model server: set, PID, draining, health")
    add_mesh_flags(show, inherited=True)
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_show)
    retire = verbs.add_parser(
        "retire", help="after a promoted blue-green update: stop the old set (no switch back)"
    )
    add_mesh_flags(retire, inherited=True)
    retire.set_defaults(func=cmd_retire)
    discard = verbs.add_parser(
        "discard", help="after a blue-green update was switched back: stop the new set"
    )
    add_mesh_flags(discard, inherited=True)
    discard.set_defaults(func=cmd_discard)
