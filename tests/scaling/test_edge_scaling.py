"""The scaler on the caller's side, on a real mesh: Predict through the real edge Envoy
breaks the objective while every replica's own signal is far under its target, and the
scaler acts on the edge's measure (grows the gateways) or names the host's saturation
instead, within the up-window and a round or two. On today's replica signals alone it
would decide nothing: every pool is "at target"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.load import BackgroundLoad, predict_target
from servemesh.observe.scrape import scrape
from servemesh.scaling.__main__ import metrics_address
from servemesh.scaling.history import read_history, read_status
from servemesh.spec.scaling_policy import (
    EdgeSignalSpec,
    PoolPolicy,
    ScalingSpec,
    ScalingTargets,
)
from tests.scaling.test_mesh_scaling import ZONE, scaled_mesh
from tests.waiting import wait_until

# Far above anything one replica reaches here: no replica's own signal asks for more.
UNREACHABLE = ScalingTargets(p99_ms=60_000.0, queue_depth=10_000.0, cpu=None, in_flight=10_000)


def edge_policy() -> ScalingSpec:
    pool = PoolPolicy(
        min=1, max=2, target=UNREACHABLE, up_window="2s", down_window="10m", cooldown="1s"
    )
    return ScalingSpec(
        interval="1s",
        drain_timeout="10s",
        model_servers=pool,
        gateway=pool,
        feature=pool,
        # 1 ms at the edge: every Predict through Envoy, the gateway, Redis and a model
        # takes more, so any load breaks it, on a fast box or a busy one.
        edge=EdgeSignalSpec(p99_ms=1.0),
    )


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with scaled_mesh(tmp_path, edge_policy()) as running:
        yield running


def _edge_decisions(mesh: Mesh) -> list[dict[str, Any]]:
    return [e for e in read_history(mesh.state_dir) if e.get("signal") == "edge"]


def test_a_breach_only_the_edge_sees_makes_the_scaler_act_or_name_saturation(
    mesh: Mesh,
) -> None:
    target = predict_target(dial_edge(mesh.spec), entities=50, timeout_s=5.0)
    load = BackgroundLoad(target, rate_per_s=30)
    load.start()
    try:
        found = wait_until(lambda: _edge_decisions(mesh), "a decision on the edge", timeout_s=90)
    finally:
        load.stop()
    assert not load.error
    decision = found[0]
    assert decision["zone"] == ZONE
    assert decision["reason"].startswith("edge p99 ") and " > 1 ms over 2s; " in decision["reason"]
    # Every replica's own signals were far under their targets when it was decided.
    signals = decision["signals"]
    assert (signals["in_flight"] or 0) < 10_000 and (signals["p99_ms"] or 0) < 60_000
    if decision["outcome"] == "held":
        # The host had no headroom: said so, not answered with replicas that cannot help.
        assert "no headroom on this host: CPU " in decision["line"], decision
    else:
        # No baseline within 1 ms ever existed: the gateways first, one step.
        assert decision["outcome"] == "done", decision
        assert (decision["pool"], decision["from"], decision["to"]) == ("gateway", 1, 2)
        assert decision["reason"].endswith("no baseline within the objective yet: gateway first")

    status = read_status(mesh.state_dir)
    assert status is not None
    edge = status["edges"][ZONE]
    assert edge["objective_p99_ms"] == 1.0 and edge["calls_per_s"] >= 0
    assert status["host"]["cores"] >= 1 and status["host"]["busy"] is not None

    # The edge's measure, as the scaler's metrics (what the mesh's Prometheus scrapes).
    address = metrics_address(mesh.state_dir)
    assert address is not None
    names = {s.name for s in scrape(address)}
    assert {"servemesh_scaler_edge", "servemesh_scaler_host_busy_ratio"} <= names
