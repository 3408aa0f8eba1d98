"""The scaler's round over every pool (model servers, gateways, feature services) and every
zone of a two-zone mesh, with the replicas' /metrics and the moves faked: each pool decides
on its own signals, in each zone on its own, and the status and history name the pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from servemesh.observe.scrape import Sample
from servemesh.proxy.apply import MeshPaths
from servemesh.scaling.history import pool_status, read_history, read_status
from servemesh.scaling.loop import Scaler
from servemesh.scaling.signals import IN_FLIGHT, SERVING_METHODS
from servemesh.scaling_policy import PoolPolicy, ScalingSpec, front_targets
from servemesh.spec import MeshSpec, Ports, ResolvedSpec, resolve


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
    spec = resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(tmp_path),
            scaling=ScalingSpec(gateway=quick, feature=quick),
        )
    )
    busy = spec.metrics_address_of("gateway-zone-a-0")
    in_flight = {busy: 80.0}

    def scrape(address: str) -> list[Sample]:
        kind = next(
            i.service for i in spec.instances() if spec.metrics_address_of(i.name) == address
        )
        method = SERVING_METHODS.get(kind, "")
        return [Sample(IN_FLIGHT, {"method": method}, in_flight.get(address, 0.0))]

    actuators = {kind: FakeActuator() for kind in ("model", "gateway", "feature")}
    scaler = Scaler(
        FakeManager(spec, MeshPaths(tmp_path)),  # type: ignore[arg-type]
        scrape=scrape,
        clock=lambda: 100.0,
        wall=lambda: datetime(2026, 12, 2, tzinfo=UTC),
        actuators=actuators,  # type: ignore[arg-type]
    )
    decisions = scaler.round()

    # Zone-a's gateways carry 80 calls in flight against 32: they grow; nothing else moves.
    assert actuators["gateway"].grown == [("zone-a", 2)]
    assert actuators["feature"].grown == actuators["model"].grown == []
    assert {(d.pool, d.zone) for d in decisions} == {
        (kind, zone) for kind in ("model", "gateway", "feature") for zone in ("zone-a", "zone-b")
    }
    status = read_status(tmp_path)
    assert pool_status(status, "gateway")["zone-a"]["signals"]["in_flight"] == 80.0
    assert pool_status(status, "gateway")["zone-b"]["signals"]["in_flight"] == 0.0
    assert pool_status(status, "model")["zone-a"]["in_rotation"] == ["model-zone-a-0"]
    [entry] = read_history(tmp_path)
    assert (entry["pool"], entry["zone"], entry["from"], entry["to"]) == ("gateway", "zone-a", 1, 2)
    assert entry["line"].endswith("gateway zone-a 1 -> 2")
