"""The scaler's round over every pool (each model pool, gateways, feature services) and every
zone of a two-zone mesh, with the replicas' /metrics and the moves faked: each pool decides
on its own signals, in each zone on its own, and the status and history name the pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from servemesh.observe.scrape import Sample
from servemesh.scaling.history import pool_status, read_history, read_status
from servemesh.scaling.loop import Scaler
from servemesh.scaling.signals import IN_FLIGHT, QUEUE, SERVING_METHODS
from servemesh.spec import MeshSpec, ModelSpec, ModelVersionSpec, Ports, ResolvedSpec, resolve
from servemesh.spec.scaling_policy import PoolPolicy, ScalingSpec, front_targets
from servemesh.state.paths import MeshPaths


@dataclass
class FakeManager:
    spec: ResolvedSpec
    paths: MeshPaths

    def live_spec(self) -> ResolvedSpec:
        return self.spec


@dataclass
class FakeActuator:
    grown: list[tuple[str, int]] = field(default_factory=list)
    shrunk: list[tuple[str, int]] = field(default_factory=list)

    def grow(self, zone: str, to: int, standby: int, reason: str) -> list[str]:
        self.grown.append((zone, to))
        return []

    def shrink(self, zone: str, to: int, standby: int, reason: str) -> list[str]:
        self.shrunk.append((zone, to))
        return []

    def keep_standby(self, zone: str, standby: int, reason: str = "") -> list[str]:
        return []


def test_each_pool_decides_on_its_own_signals_in_each_zone(tmp_path: Path) -> None:
    quick = PoolPolicy(up_window="0s", cooldown="0s", target=front_targets())
    quick_models = PoolPolicy(up_window="0s", cooldown="0s")
    risk = ModelSpec(versions={"v1": ModelVersionSpec(source="demo:3")}, traffic={"v1": 100})
    spec = resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(tmp_path),
            models={"fraud": ModelSpec(), "risk": risk},
            scaling=ScalingSpec(gateway=quick, feature=quick, model_servers=quick_models),
        )
    )
    busy_gateway = spec.metrics_address_of("gateway-zone-a-0")
    busy_model = spec.metrics_address_of("model-risk-zone-b-0")
    in_flight = {busy_gateway: 80.0}
    queued = {busy_model: 16.0}

    def scrape(address: str) -> list[Sample]:
        kind = next(
            i.service for i in spec.instances() if spec.metrics_address_of(i.name) == address
        )
        method = SERVING_METHODS.get(kind, "")
        return [
            Sample(IN_FLIGHT, {"method": method}, in_flight.get(address, 0.0)),
            Sample(QUEUE, {}, queued.get(address, 0.0)),
        ]

    pools = ("model-fraud", "model-risk", "gateway", "feature")
    actuators = {label: FakeActuator() for label in pools}
    scaler = Scaler(
        FakeManager(spec, MeshPaths(tmp_path)),  # type: ignore[arg-type]
        scrape=scrape,
        clock=lambda: 100.0,
        wall=lambda: datetime(2026, 12, 2, tzinfo=UTC),
        actuators=actuators,  # type: ignore[arg-type]
    )
    decisions = scaler.round()

    # Zone-a's gateways carry 80 calls in flight against 32: they grow. Risk's zone-b server
    # queues 16 against 8: risk's pool grows there, and fraud's pool, on processes of its
    # own, stays as it is. Nothing else moves.
    assert actuators["gateway"].grown == [("zone-a", 2)]
    assert actuators["model-risk"].grown == [("zone-b", 2)]
    assert actuators["feature"].grown == actuators["model-fraud"].grown == []
    assert {(d.pool, d.zone) for d in decisions} == {
        (label, zone) for label in pools for zone in ("zone-a", "zone-b")
    }
    status = read_status(tmp_path)
    assert pool_status(status, "gateway")["zone-a"]["signals"]["in_flight"] == 80.0
    assert pool_status(status, "gateway")["zone-b"]["signals"]["in_flight"] == 0.0
    assert pool_status(status, "model-fraud")["zone-a"]["in_rotation"] == ["model-fraud-zone-a-0"]
    assert pool_status(status, "model-risk")["zone-b"]["in_rotation"] == ["model-risk-zone-b-0"]
    assert pool_status(status, "model-risk")["zone-b"]["signals"]["queue_depth"] == 16.0
    entries = sorted((e["pool"], e["zone"], e["from"], e["to"]) for e in read_history(tmp_path))
    assert entries == [("gateway", "zone-a", 1, 2), ("model-risk", "zone-b", 1, 2)]
    lines = {e["pool"]: e["line"] for e in read_history(tmp_path)}
    assert lines["model-risk"].endswith("model-risk zone-b 1 -> 2")
