"""The scaler on a real mesh, a process beside it as `servemesh up` runs it: a warm standby
is started behind the rotation, load takes it into rotation (and a new standby starts), the
replica it promoted answers calls, and an `apply` that lowers the pool's max takes the zone
back down under the same load, draining before it stops anything: not one call fails across
both moves, and `servemesh scale history` shows each decision with its inputs (the
scaler's /metrics count them too).

The pool's p99 target is far below what any call takes (0.5 ms), so load is what asks for a
scale-up, whatever the machine's speed: the test proves the moves, not the thresholds
(those are tests/unit/test_scaling_decide.py's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.load import BackgroundLoad, predict_target
from servemesh.observe.scrape import scrape
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_apply import LiveApply
from servemesh.proxy.replicas import served_health_names, version_health
from servemesh.rollout.fleet import fleet_status
from servemesh.scaling.__main__ import metrics_address
from servemesh.scaling.history import pool_status, read_history, read_status
from servemesh.scaling.signals import SERVING_METHODS
from servemesh.spec import DemoSpec, MeshSpec, ModelSpec, ModelVersionSpec, Ports, Replicas
from servemesh.spec.scaling_policy import (
    EdgeSignalSpec,
    HostHeadroomSpec,
    PoolPolicy,
    ScalingSpec,
    ScalingTargets,
)
from tests.waiting import wait_until

ZONE = "zone-a"
FIRST, PROMOTED, NEXT_STANDBY = (f"model-fraud-{ZONE}-{i}" for i in range(3))


# These tests ask what the replicas' own signals do: the caller's side and the host's
# headroom are tests/scaling/test_edge_scaling.py's (on a two-core box under load the host
# guard would rightly hold the growth these tests wait for).
NO_EDGE, NO_HOST_GUARD = EdgeSignalSpec(enabled=False), HostHeadroomSpec(enabled=False)


def scaling(max_replicas: int) -> ScalingSpec:
    return ScalingSpec(
        edge=NO_EDGE,
        host=NO_HOST_GUARD,
        interval="1s",
        drain_timeout="10s",
        model_servers=PoolPolicy(
            min=1,
            max=max_replicas,
            target=ScalingTargets(p99_ms=0.5, queue_depth=None, cpu=None),
            up_window="2s",
            down_window="30s",
            cooldown="1s",
            standby=1,
        ),
    )


@contextmanager
def scaled_mesh(tmp_path: Path, policy: ScalingSpec) -> Iterator[Mesh]:
    """One zone, one replica of each kind, fraud v1 on the demo model, no Prometheus; the
    scaler runs beside it as `servemesh up` runs it, with `policy`."""
    one = Replicas(per_zone={ZONE: 1})
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(tmp_path / "state"),
        zones=[ZONE],
        gateway=one,
        feature=one,
        model_servers=one,
        models={
            "fraud": ModelSpec(
                versions={"v1": ModelVersionSpec(source="demo:1")}, traffic={"v1": 100}
            )
        },
        demo=DemoSpec(enabled=True, entities=50),
        scaling=policy,
    )
    spec = spec.model_copy(
        update={"metrics": spec.metrics.model_copy(update={"prometheus": "off"})}
    )
    running = Mesh.from_spec(spec)
    running.scaler = True
    with running:
        yield running


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with scaled_mesh(tmp_path, scaling(2)) as running:
        yield running


def _status(mesh: Mesh) -> dict[str, Any]:
    zones = pool_status(read_status(mesh.state_dir), "model-fraud")
    found: dict[str, Any] = zones.get(ZONE, {})
    return found


def _serving(mesh: Mesh, name: str) -> bool:
    spec = RouteManager(mesh.paths).live_spec()
    if name not in {i.name for i in spec.instances()}:
        return False
    return all(version_health(spec, name, served_health_names(spec, name)).values())


def _done(mesh: Mesh, start: int, end: int) -> list[dict[str, Any]]:
    return [
        e
        for e in read_history(mesh.state_dir)
        if (e["zone"], e["from"], e["to"], e["outcome"]) == (ZONE, start, end, "done")
    ]


def test_load_promotes_the_standby_and_a_lower_max_drains_back_without_a_failed_call(
    mesh: Mesh,
) -> None:
    # At idle the scaler starts the pool's standby behind the rotation, and it warms up.
    wait_until(lambda: _status(mesh).get("standby") == [PROMOTED], "a standby", timeout_s=60)
    wait_until(lambda: _serving(mesh, PROMOTED), "the standby to hold v1", timeout_s=120)

    target = predict_target(dial_edge(mesh.spec), entities=50, timeout_s=5.0)
    load = BackgroundLoad(target, rate_per_s=40)
    load.start()
    try:
        grown = wait_until(lambda: _done(mesh, 1, 2), "a scale-up to 2", timeout_s=120)
        assert "p99_ms" in grown[0]["reason"] and grown[0]["signals"]["calls_per_s"] > 0
        wait_until(
            lambda: any(o.replica == PROMOTED for o in list(load.outcomes)),
            f"{PROMOTED} to answer calls",
        )
        # The promotion started a new standby behind the rotation.
        wait_until(lambda: _status(mesh).get("standby") == [NEXT_STANDBY], "a new standby")
        assert _status(mesh)["in_rotation"] == [FIRST, PROMOTED]

        # An operator lowers the pool's max under load: the zone goes back to one replica.
        applier = LiveApply(RouteManager(mesh.paths, AdminClient.of_mesh(mesh.state_dir)))
        text = json.dumps({"scaling": scaling(1).model_dump(mode="json")})
        lines = applier.apply(text, "lower-max.yaml").plan.lines()
        assert any(line.startswith("~ scaling: model servers 1..2") for line in lines), lines
        shrunk = wait_until(lambda: _done(mesh, 2, 1), "a scale-in to 1", timeout_s=120)
        assert shrunk[0]["reason"] == "max 1"
        wait_until(
            lambda: NEXT_STANDBY not in fleet_status(mesh.state_dir), f"{NEXT_STANDBY} stopped"
        )
        settled = load.now_s()
        wait_until(lambda: len(load.run.window(settled)) >= 40, "a second of load after it")
    finally:
        load.stop()
    assert not load.error
    failed = [o for o in load.snapshot() if not o.ok]
    assert not failed, failed[:3]
    assert {o.replica for o in load.run.window(settled)} == {FIRST}
    assert _status(mesh)["standby"] == [PROMOTED]  # in rotation no more, kept warm

    # The same decisions as the scaler's metrics (what the mesh's Prometheus scrapes).
    address = metrics_address(mesh.state_dir)
    assert address is not None
    samples = scrape(address)

    def value(name: str, **labels: str) -> float:
        return sum(
            s.value for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )  # fmt: skip

    decisions = "servemesh_scaler_decisions_total"
    assert value(decisions, pool="model-fraud", zone=ZONE, direction="up", outcome="done") >= 1
    assert value(decisions, pool="model-fraud", zone=ZONE, direction="down", outcome="done") >= 1
    assert (
        value("servemesh_scaler_replicas", pool="model-fraud", zone=ZONE, state="in_rotation") == 1
    )
    assert value("servemesh_scaler_rounds_total", outcome="ok") >= 1

    shown = subprocess.run(
        [sys.executable, "-m", "servemesh", "scale", "history", "--state-dir", str(mesh.state_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "1 -> 2" in shown.stdout and "2 -> 1" in shown.stdout and "max 1" in shown.stdout


# --- gateways and feature services: pools of their own ---------------------------------

GATEWAYS = [f"gateway-{ZONE}-{i}" for i in range(2)]
FEATURES = [f"feature-{ZONE}-{i}" for i in range(2)]


def front_scaling(max_replicas: int) -> ScalingSpec:
    """The gateways and the feature services between 1 and `max_replicas`, on a Predict (a
    GetFeatures) p99 far below what any call takes, so load alone asks for more; the model
    servers held at one."""
    pool = PoolPolicy(
        min=1,
        max=max_replicas,
        target=ScalingTargets(p99_ms=0.5, queue_depth=None, cpu=None),
        up_window="2s",
        down_window="30s",
        cooldown="1s",
    )
    return ScalingSpec(
        edge=NO_EDGE,
        host=NO_HOST_GUARD,
        interval="1s",
        drain_timeout="10s",
        model_servers=PoolPolicy(min=1, max=1),
        gateway=pool,
        feature=pool,
    )


@pytest.fixture
def front_mesh(tmp_path: Path) -> Iterator[Mesh]:
    with scaled_mesh(tmp_path, front_scaling(2)) as running:
        yield running


def _served(mesh: Mesh, name: str, method: str) -> float:
    """Calls of `method` the replica itself counted as answered OK."""
    live = RouteManager(mesh.paths).live_spec()
    samples = scrape(live.metrics_address_of(name))
    return sum(
        s.value
        for s in samples
        if s.name == "servemesh_rpc_requests_total"
        and s.labels.get("method") == method
        and s.labels.get("code") == "OK"
    )


def _stopped(mesh: Mesh, name: str) -> bool:
    return name not in fleet_status(mesh.state_dir)


def _pool_done(mesh: Mesh, pool: str, start: int, end: int) -> list[dict[str, Any]]:
    return [
        e
        for e in read_history(mesh.state_dir)
        if (e.get("pool"), e["zone"], e["from"], e["to"], e["outcome"])
        == (pool, ZONE, start, end, "done")
    ]


def test_gateways_and_feature_services_grow_under_load_and_drain_back_without_a_failed_call(
    front_mesh: Mesh,
) -> None:
    mesh = front_mesh
    target = predict_target(dial_edge(mesh.spec), entities=50, timeout_s=5.0)
    load = BackgroundLoad(target, rate_per_s=40)
    load.start()
    try:
        for pool in ("gateway", "feature"):
            grown = wait_until(
                partial(_pool_done, mesh, pool, 1, 2), f"{pool}s: 1 -> 2", timeout_s=120
            )
            assert "p99_ms" in grown[0]["reason"], grown[0]
        # The new replicas take their share of the calls: the edge sends Predicts to the
        # second gateway, the zone's Envoy GetFeatures to the second feature service.
        wait_until(lambda: _served(mesh, GATEWAYS[1], SERVING_METHODS["gateway"]) > 0, GATEWAYS[1])
        wait_until(lambda: _served(mesh, FEATURES[1], SERVING_METHODS["feature"]) > 0, FEATURES[1])
        # The mesh started them, by PID, as any replica.
        started = fleet_status(mesh.state_dir)
        assert all(started[n]["pid"] for n in GATEWAYS + FEATURES), started

        # An operator lowers both pools' max under load: each drains its second replica.
        applier = LiveApply(RouteManager(mesh.paths, AdminClient.of_mesh(mesh.state_dir)))
        text = json.dumps({"scaling": front_scaling(1).model_dump(mode="json")})
        lines = applier.apply(text, "lower-max.yaml").plan.lines()
        assert any("gateways 1..1 per zone" in line for line in lines), lines
        for pool, names in (("gateway", GATEWAYS), ("feature", FEATURES)):
            shrunk = wait_until(
                partial(_pool_done, mesh, pool, 2, 1), f"{pool}s: 2 -> 1", timeout_s=120
            )
            assert shrunk[0]["reason"] == "max 1"
            wait_until(partial(_stopped, mesh, names[1]), f"{names[1]} stopped")
        settled = load.now_s()
        wait_until(lambda: len(load.run.window(settled)) >= 40, "a second of load after it")
    finally:
        load.stop()
    assert not load.error
    failed = [o for o in load.snapshot() if not o.ok or o.degraded]
    assert not failed, failed[:3]
    live = RouteManager(mesh.paths).live_spec()
    assert [i.name for i in live.instances() if i.service in ("gateway", "feature")] == [
        FEATURES[0],
        GATEWAYS[0],
    ]
    status_argv = ["scale", "status", "--json", "--state-dir", str(mesh.state_dir)]
    shown = subprocess.run(
        [sys.executable, "-m", "servemesh", *status_argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    rows = {(r["pool"], r["zone"]): r for r in json.loads(shown.stdout)["pools"]}
    assert rows[("gateway", ZONE)]["in_rotation"] == 1 and rows[("gateway", ZONE)]["max"] == 1
