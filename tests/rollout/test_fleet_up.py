"""A blue-green update from another process than `servemesh up`: the mesh starts the green
replicas as its own children, and its stop (SIGTERM, as Ctrl-C) stops them by PID."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from servemesh.procs import Check, Supervisor
from servemesh.proxy.apply import RouteManager
from servemesh.rollout.fleet import StrategyContext, fleet_status, run_blue_green
from servemesh.rollout.types import Outcome
from servemesh.spec import DemoSpec, MeshSpec, ModelSpec, ModelVersionSpec, Ports, Replicas
from servemesh.spec.rollout_plan import RolloutPlan
from servemesh.state.paths import MeshPaths

pytestmark = pytest.mark.mesh

GREEN = "model-fraud-green-zone-a-0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _parent_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def test_the_mesh_owns_the_green_set_and_stops_it(tmp_path: Path) -> None:
    one = Replicas(per_zone={"zone-a": 1})
    state = tmp_path / "state"
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(state),
        zones=["zone-a"],
        gateway=one,
        feature=one,
        model_servers=one,
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="demo:2"),
                },
                traffic={"v1": 100, "v2": 0},
            )
        },
        demo=DemoSpec(enabled=True, entities=20),
    )
    spec = spec.model_copy(
        update={"metrics": spec.metrics.model_copy(update={"prometheus": "off"})}
    )
    spec_path = tmp_path / "mesh.yaml"
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    endpoints = state / "endpoints.json"
    with Supervisor(tmp_path / "logs") as supervisor:
        up = supervisor.start(
            "up",
            [sys.executable, "-m", "servemesh", "up", "--spec", str(spec_path)],
            ready=Check(endpoints.exists, f"{endpoints} written"),
            timeout_s=180,
        )
        manager = RouteManager(MeshPaths(state))
        lines: list[str] = []
        ending = run_blue_green(
            StrategyContext(
                manager=manager,
                spec=manager.live_spec(),
                model="fraud",
                version="v2",
                baseline="v1",
                plan=RolloutPlan(strategy="blue-green"),
                say=lines.append,
                ready_timeout_s=120,
            )
        )
        assert ending.outcome == Outcome.PROMOTED, ending.reason
        status = fleet_status(state, "model")
        pids = {name: int(entry["pid"] or 0) for name, entry in status.items()}
        assert set(pids) == {"model-fraud-zone-a-0", GREEN}
        # Started by the mesh, not by this process: `up` is their parent.
        assert _parent_of(pids[GREEN]) == up.pid
        assert all(_alive(pid) for pid in pids.values())

        assert supervisor.stop("up", grace_s=60) == 0
        assert not [name for name, pid in pids.items() if _alive(pid)]
        assert not (state / "fleet-status.json").exists()
