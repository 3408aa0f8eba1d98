"""`servemesh status`: the running mesh a state dir names, from any shell: who started it
(the `up` process's PID), its endpoint table again, and each process's PID, state and
health now. `servemesh down` stops it (servemesh/cli/down.py)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.cli.endpoint_table import Endpoint, endpoint_rows, endpoint_table
from servemesh.cli.flags import add_output
from servemesh.cli.mesh import add_mesh_flags, state_dir_of
from servemesh.cli.output import out, write
from servemesh.contract.errors import NoMesh
from servemesh.proxy.admin import AdminClient, admin_socket_path
from servemesh.rollout.fleet import fleet_status, mesh_processes_status
from servemesh.spec import ResolvedSpec
from servemesh.state.lock import Holder, live_holder, pid_alive
from servemesh.state.paths import MeshPaths

# Each probe's bound: a hung process reads as "no answer", never as a hung command.
PROBE_TIMEOUT_S = 2.0


def held_mesh(args: argparse.Namespace) -> tuple[Path, Holder]:
    """The state dir the flags name and the live mesh holding it; NoMesh (exit 5) when no
    live process holds it (a killed mesh's leftovers included)."""
    state_dir = state_dir_of(args)
    holder = live_holder(state_dir)
    if holder is None:
        raise NoMesh(state_dir)
    return state_dir, holder


def current_pids(state_dir: Path, endpoints: dict[str, Any]) -> dict[str, int]:
    """Each process's PID now: as `up` recorded them, then as the mesh rewrote them after
    restarting a process (its fleet status)."""
    pids = {str(k): int(v) for k, v in dict(endpoints.get("pids", {})).items()}
    for name, entry in {**fleet_status(state_dir), **mesh_processes_status(state_dir)}.items():
        if isinstance(entry, dict) and isinstance(entry.get("pid"), int):
            pids[name] = entry["pid"]
    return pids


def states(state_dir: Path, rows: list[Endpoint], pids: dict[str, int]) -> dict[str, str]:
    """Each process row's state: "gone" when its PID is, else the mesh's own word for a
    process it restarts (running, restarting, held, exited), else "running"."""
    recorded = {**fleet_status(state_dir), **mesh_processes_status(state_dir)}
    found = {}
    for row in rows:
        if row.process not in pids:
            continue
        entry = recorded.get(row.process)
        if not pid_alive(pids[row.process]):
            found[row.what] = "gone"
        elif isinstance(entry, dict) and entry.get("state"):
            found[row.what] = str(entry["state"])
        else:
            found[row.what] = "running"
    return found


def _grpc_health(spec: ResolvedSpec, instance: str) -> str:
    from servemesh.identity import dial_service

    try:
        with dial_service(spec, instance).channel() as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
            )
    except grpc.RpcError as exc:
        return f"no answer ({exc.code().name})"
    except (OSError, ValueError) as exc:  # the operator's certificate unreadable
        return f"unknown ({exc})"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _envoy_health(state_dir: Path, proxy: str) -> str:
    ready = AdminClient(admin_socket_path(state_dir, proxy), PROBE_TIMEOUT_S).is_ready()
    return "ready" if ready else "not ready"


def health(state_dir: Path, spec: ResolvedSpec, rows: list[Endpoint]) -> dict[str, str]:
    """Each row's health now: grpc.health.v1 on a service's own port (mutual TLS, the
    operator's certificate), an Envoy's /ready on its admin socket; probed side by side."""

    def probe(row: Endpoint) -> str:
        if row.instance:
            return _grpc_health(spec, row.instance)
        if row.proxy:
            return _envoy_health(state_dir, row.proxy)
        return ""

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(probe, rows))
    return {row.what: answer for row, answer in zip(rows, answers, strict=True) if answer}


def _since(holder: Holder) -> str:
    if not holder.started_at:
        return ""
    return time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(holder.started_at))


def cmd_status(args: argparse.Namespace) -> int:
    state_dir, holder = held_mesh(args)
    paths = MeshPaths(state_dir)
    head = (
        f"mesh at {state_dir}: `servemesh up` pid {holder.pid}{_since(holder)}, edge {holder.edge}"
    )
    if not paths.endpoints.is_file() or not paths.resolved_spec.is_file():
        # Between taking the state dir and every service reporting SERVING.
        if args.json:
            write(json.dumps({"state_dir": str(state_dir), "state": "starting", **_who(holder)}))
        else:
            out.print(f"{head}; starting (its endpoints come once every service is SERVING)")
        return 0
    spec = paths.running_spec()
    endpoints = dict(json.loads(paths.endpoints.read_text()))
    rows = endpoint_rows(spec, endpoints)
    pids = current_pids(state_dir, endpoints)
    columns = {"state": states(state_dir, rows, pids), "health": health(state_dir, spec, rows)}
    if args.json:
        processes = [
            {
                "endpoint": row.what,
                "address": row.address,
                "pid": pids.get(row.process) if row.process else None,
                **{name: column.get(row.what) for name, column in columns.items()},
            }
            for row in rows
        ]
        answer = {"state_dir": str(state_dir), "state": "running", **_who(holder)}
        write(json.dumps({**answer, "processes": processes}))
        return 0
    out.print(head)
    out.print(endpoint_table("endpoints", rows, pids, columns))
    out.print(f"logs: {endpoints.get('logs', '')}")
    return 0


def _who(holder: Holder) -> dict[str, object]:
    return {"pid": holder.pid, "edge": holder.edge, "started_at": holder.started_at}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    status = sub.add_parser(
        "status",
        help="the running mesh: who started it, its endpoints, each process's PID and health",
    )
    add_mesh_flags(status)
    add_output(status, "one JSON object: who holds the mesh, every endpoint")
    status.set_defaults(func=cmd_status)
