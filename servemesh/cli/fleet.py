"""`servemesh fleet ...`: the model-server sets of a running mesh, and the explicit steps
that end a blue-green update (docs/rollouts-fleet.md)."""

from __future__ import annotations

import argparse
import json
import signal
from typing import Any

from rich.table import Table

from servemesh.cli.flags import add_output
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out, write
from servemesh.proxy.admin import AdminError
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.replicas import envoy_hosts
from servemesh.rollout.fleet import (
    discard_new_set,
    fleet_status,
    mesh_processes_status,
    retire_old_set,
)
from servemesh.spec import Instance, ReplicaSet


def _manager(args: argparse.Namespace) -> RouteManager:
    return RouteManager(running_mesh(args).paths)


def fleet_rows(manager: RouteManager) -> list[dict[str, object]]:
    """One row per model server: its set, zone, PID and generation (as the mesh started
    it), whether it drains, what it serves, in how many clusters Envoy counts it healthy,
    its state and how often the mesh started it again after a crash (its last exit)."""
    spec = manager.live_spec()
    status = fleet_status(manager.paths.state_dir)
    try:
        hosts = envoy_hosts(manager)
    except (AdminError, OSError, ValueError):
        hosts = {}
    rows: list[dict[str, object]] = []
    # The first set's replicas (each pool's under its home name), then each second set's.
    members: list[tuple[Instance, ReplicaSet | None]] = [
        (inst, None) for inst in spec.first_set_replicas()
    ]
    for second in spec.fleet.sets[1:]:
        members += [
            (inst, second)
            for pool in second.pools or spec.pool_names()
            for inst in spec.set_replicas(second.name, pool)
        ]
    for inst, replica_set in members:
        if replica_set is None:
            set_name = inst.replica_set or "first"
            others = spec.fleet.sets_in(inst.pool)
            serves = "every other version" if others else "every version"
        else:
            set_name = replica_set.name
            serves = ", ".join(f"{m} {' '.join(v)}" for m, v in sorted(replica_set.serves.items()))
        address = "{}:{}".format(*spec.endpoint_of(inst.name))
        listed = [h[address] for h in hosts.values() if address in h]
        rows.append(
            {
                "set": set_name,
                "pool": inst.pool,
                "replica": inst.name,
                "zone": inst.zone,
                "pid": status.get(inst.name, {}).get("pid"),
                "generation": spec.fleet.generations.get(inst.name, 0),
                "draining": inst.name in spec.fleet.draining,
                "serves": serves or "-",
                "healthy_in_clusters": f"{sum(h.healthy for h in listed)}/{len(listed)}",
                **restart_fields(status.get(inst.name, {})),
            }
        )
    return rows


def restart_fields(entry: dict[str, Any]) -> dict[str, object]:
    """A process's state, restarts after unexpected exits and last such exit, from its
    fleet status entry (a mesh from before restarts were counted: running, 0, None)."""
    return {
        "state": entry.get("state", "running"),
        "restarts": entry.get("restarts", 0),
        "last_exit": entry.get("last_exit"),
        # "liveness: ..." when the mesh killed it for failing its liveness checks.
        "last_cause": entry.get("last_cause"),
    }


def last_exit_text(fields: dict[str, object]) -> str:
    """The last unexpected exit, with what caused it when the mesh did (`SIGKILL
    (liveness)`)."""
    text = exit_text(fields["last_exit"])
    cause = fields.get("last_cause")
    if isinstance(cause, str) and cause:
        text += f" ({cause.split(':', 1)[0]})"
    return text


def exit_text(status: object) -> str:
    """An exit status as an operator reads it: the signal's name, or `exit N`."""
    if not isinstance(status, int):
        return "-"
    if status < 0:
        try:
            return signal.Signals(-status).name
        except ValueError:
            return f"signal {-status}"
    return f"exit {status}"


def cmd_show(args: argparse.Namespace) -> int:
    manager = _manager(args)
    rows = fleet_rows(manager)
    if args.json:
        write(json.dumps(rows))
        return 0
    table = Table(title="model servers", title_justify="left")
    columns = ("set", "replica", "zone", "pid", "gen", "draining", "serves", "healthy")
    for column in (*columns, "state", "restarts", "last exit"):
        numeric = column in ("pid", "gen", "restarts")
        table.add_column(column, justify="right" if numeric else "left")
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
            str(row["state"]),
            str(row["restarts"]),
            last_exit_text(row),
        )
    out.print(table)
    _print_other_restarts(manager)
    return 0


def _print_other_restarts(manager: RouteManager) -> None:
    """The mesh's other processes it starts again (gateways, feature services, registry,
    trace store, per-zone Envoys) that crashed or are not running, one line each."""
    others = dict(fleet_status(manager.paths.state_dir))
    others.update(mesh_processes_status(manager.paths.state_dir))
    for name, entry in sorted(others.items()):
        fields = restart_fields(entry)
        if entry.get("service") == "model" or (
            fields["restarts"] == 0 and fields["state"] == "running"
        ):
            continue
        out.print(
            f"{name}: {fields['state']}, started again {fields['restarts']} time(s), "
            f"last exit {last_exit_text(fields)}",
            highlight=False,
        )


def cmd_retire(args: argparse.Namespace) -> int:
    retire_old_set(
        _manager(args), pool=args.pool, say=lambda line: out.print(line, highlight=False)
    )
    return 0


def cmd_discard(args: argparse.Namespace) -> int:
    discard_new_set(
        _manager(args), pool=args.pool, say=lambda line: out.print(line, highlight=False)
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fleet = sub.add_parser(
        "fleet", help="the model-server sets (blue-green, rolling updates) of the running mesh"
    )
    add_mesh_flags(fleet)
    verbs = fleet.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser(
        "show", help="every model server: set, PID, draining, health, restarts after crashes"
    )
    add_mesh_flags(show, inherited=True)
    add_output(show)
    show.set_defaults(func=cmd_show)
    retire = verbs.add_parser(
        "retire", help="after a promoted blue-green update: stop the old set (no switch back)"
    )
    add_mesh_flags(retire, inherited=True)
    add_pool_flag(retire)
    retire.set_defaults(func=cmd_retire)
    discard = verbs.add_parser(
        "discard", help="after a blue-green update was switched back: stop the new set"
    )
    add_mesh_flags(discard, inherited=True)
    add_pool_flag(discard)
    discard.set_defaults(func=cmd_discard)


def add_pool_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pool",
        default=None,
        help="the pool whose second set to act on (needed only while several pools have one)",
    )
