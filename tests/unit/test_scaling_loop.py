"""The scaler's round over every pool (each model pool, gateways, feature services) and every
zone of a two-zone mesh, with the replicas' /metrics and the moves faked: each pool decides
on its own signals, in each zone on its own, and the status and history name the pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from servemesh.observe.scrape import Sample
from servemesh.scaling.history import pool_status, read_history, read_status
from servemesh.scaling.host import HostReader
from servemesh.scaling.loop import Scaler
from servemesh.scaling.signals import IN_FLIGHT, QUEUE, SERVING_METHODS
from servemesh.spec import MeshSpec, ModelSpec, ModelVersionSpec, Ports, ResolvedSpec, resolve
from servemesh.spec.scaling_policy import PoolPolicy, ScalingSpec, front_targets
from servemesh.state.paths import MeshPaths


def quiet_host() -> HostReader:
    """A host with room to spare, whatever the machine running the test is doing."""
    return HostReader(lambda path: "cpu  100 0 100 800 0 0 0 0\nprocs_running 1\n", cores=2)


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
        host=quiet_host(),
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


# A weekly peak in the prediction log: 0.1 calls/s in two hours of each week, 0.005 in the
# others, for the two weeks before this one; one model server carries 0.02 calls/s within
# its targets.
PEAK_RPS, QUIET_RPS, CAPACITY_RPS = 0.1, 0.005, 0.02


def test_the_forecast_from_the_prediction_log_raises_the_floor_before_the_weekly_peak(
    tmp_path: Path,
) -> None:
    """End to end through the scaler's round: the history comes from the mesh's own
    prediction log (Parquet files a gateway wrote, read the way `servemesh up`'s scaler
    reads them), the two hours after now plus the lead are the peak of each past week,
    and the round raises fraud's pool in both zones to the forecast's floor before any
    load arrives; three hours later, past the peak, the same history raises nothing."""
    from servemesh.predlog.buffer import predictions_dir
    from servemesh.predlog.parquet_store import ParquetStore
    from tests.predlog.records import row

    lead = timedelta(minutes=10)
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    peak_start = (now + lead).replace(minute=0)
    rows = []
    # Two weeks, inside the three the scaler reads back from now: a third week's peak would
    # start up to an hour before that horizon and be cut by as many minutes as now is past
    # the hour (the test would then depend on the clock).
    for week in (1, 2):
        start = peak_start - timedelta(weeks=week)
        for hour in range(7 * 24):
            at = start - timedelta(hours=3) + timedelta(hours=hour)
            if at >= now - timedelta(hours=1):
                break
            rate = PEAK_RPS if start <= at < start + timedelta(hours=2) else QUIET_RPS
            calls = round(rate * 3600)
            rows += [
                row(at.timestamp() + i * 3600 / calls, request_id=f"w{week}h{hour}c{i}")
                for i in range(calls)
            ]
    store = ParquetStore(predictions_dir(tmp_path), "gateway-zone-a-0")
    store.write(rows)
    store.close()

    forecasting = PoolPolicy.model_validate(
        {
            "min": 1,
            "max": 4,
            "up_window": "0s",
            "cooldown": "0s",
            "forecast": {
                "enabled": True,
                "lead": "10m",
                "capacity_rps": CAPACITY_RPS,
                "weeks": 3,
            },
        }
    )
    spec = resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(tmp_path),
            scaling=ScalingSpec(model_servers=forecasting),
        )
    )

    def idle(address: str) -> list[Sample]:
        return []  # no load yet: only the forecast can move the pool

    def round_at(wall: datetime) -> FakeActuator:
        actuator = FakeActuator()
        actuators = {"model-fraud": actuator, "gateway": FakeActuator(), "feature": FakeActuator()}
        scaler = Scaler(
            FakeManager(spec, MeshPaths(tmp_path)),  # type: ignore[arg-type]
            scrape=idle,
            clock=lambda: 100.0,
            wall=lambda: wall,
            actuators=actuators,  # type: ignore[arg-type]
            host=quiet_host(),
        )
        decisions = scaler.round()
        fraud = [d for d in decisions if d.pool == "model-fraud"]
        assert fraud, decisions
        return actuator

    # 0.1 calls/s shared by two zones at 0.02 a replica: 3 each, raised before the peak.
    before = round_at(now)
    assert sorted(before.grown) == [("zone-a", 3), ("zone-b", 3)]
    entry = [e for e in read_history(tmp_path) if e["pool"] == "model-fraud"][0]
    assert "forecast" in entry["line"], entry
    after = round_at(now + timedelta(hours=3))
    assert after.grown == []
