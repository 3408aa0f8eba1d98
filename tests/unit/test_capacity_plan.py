"""The capacity plan's arithmetic: the knee of a step load, each kind's capacity from its
CPU per call, replicas with headroom, cost per hour and per million, and the measured
capacity the scaler's forecast takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from servemesh.capacity.plan import (
    Step,
    capacities,
    knee,
    measured_model_capacity,
    plan_for,
    save_measurement,
)
from servemesh.scaling.forecast import replica_capacity
from servemesh.spec import CostSpec, MeshSpec
from servemesh.spec.scaling_policy import DEFAULT_CAPACITY_RPS


def step(rate: float, p99: float, ok: int = 100, calls: int = 100, **cpu: float) -> Step:
    return Step(
        rate_rps=rate,
        seconds=1.0,
        calls=calls,
        ok=ok,
        p99_ms=p99,
        cpu_seconds=cpu or {"gateway": 0.2, "model": 0.1},
        rss_gib={"gateway": 0.1, "model": 0.5},
    )


def test_the_knee_is_the_last_step_before_the_first_breach() -> None:
    steps = [step(10, 5), step(20, 8), step(40, 30), step(80, 9)]
    found = knee(steps, p99_ms=10)
    assert found is not None and found.rate_rps == 20  # the 80 after the breach is not used
    assert knee([step(10, 50)], p99_ms=10) is None
    # Failed calls breach too, whatever the p99.
    assert knee([step(10, 5), step(20, 5, ok=99, calls=100)], p99_ms=10).rate_rps == 10  # type: ignore[union-attr]


def test_capacity_per_replica_is_cores_over_cpu_per_call() -> None:
    caps = capacities(step(100, 5, ok=100, gateway=0.2, model=0.05), cores_per_replica=2.0)
    assert caps["gateway"].cpu_ms_per_call == pytest.approx(2.0)
    assert caps["gateway"].rps_per_replica == pytest.approx(1000.0)  # 2 cores / 2 ms
    assert caps["model"].rps_per_replica == pytest.approx(4000.0)
    assert "feature" not in caps  # not measured: not planned


def test_replicas_leave_the_headroom_free_and_are_priced() -> None:
    caps = capacities(step(100, 5, ok=100, gateway=0.2, model=0.05), cores_per_replica=1.0)
    cost = CostSpec(per_core_hour=0.10, per_gib_hour=0.01, per_gpu_hour=3.0)
    plan = plan_for(
        "fraud", caps, target_rps=1000, p99_ms=10, headroom=0.5, cost=cost,
        gpus_per_model_replica=1,
    )  # fmt: skip
    by = {k.kind: k for k in plan.kinds}
    # gateway: 500/s a replica, half of it usable -> 250/s -> 4 replicas
    assert by["gateway"].replicas == 4 and by["gateway"].utilisation == pytest.approx(0.5)
    # model: 2000/s a replica -> 1000 usable -> 1 replica
    assert by["model"].replicas == 1
    assert by["gateway"].cost_per_hour == pytest.approx(4 * (0.10 + 0.1 * 0.01))
    assert by["model"].cost_per_hour == pytest.approx(0.10 + 0.5 * 0.01 + 3.0)
    total = by["gateway"].cost_per_hour + by["model"].cost_per_hour
    assert plan.cost_per_hour == pytest.approx(total, abs=1e-4)
    assert plan.cost_per_million == pytest.approx(total / (1000 * 3600) * 1e6, abs=1e-4)
    with pytest.raises(ValueError, match="headroom"):
        plan_for("fraud", caps, target_rps=1, p99_ms=1, headroom=1.0, cost=cost)


def test_the_forecast_takes_the_spec_then_the_measurement_then_the_default(
    tmp_path: Path,
) -> None:
    spec = MeshSpec()
    assert replica_capacity(spec, tmp_path) == (DEFAULT_CAPACITY_RPS, "the default")
    caps = capacities(step(100, 5, ok=100, gateway=0.2, model=0.04), cores_per_replica=1.0)
    save_measurement(tmp_path, "fraud", [step(100, 5)], caps, p99_ms=10)
    assert measured_model_capacity(tmp_path, ["fraud"]) == pytest.approx(2500.0)
    assert replica_capacity(spec, tmp_path)[0] == pytest.approx(2500.0)
    pinned = MeshSpec.model_validate(
        {"scaling": {"model_servers": {"forecast": {"capacity_rps": 123}}}}
    )
    assert replica_capacity(pinned, tmp_path) == (123.0, "the spec's")


def test_prices_set_where_they_used_to_be_still_count() -> None:
    old = MeshSpec.model_validate({"metrics": {"price_per_core_hour": 0.07}})
    assert old.cost.per_core_hour == 0.07
    with pytest.raises(ValueError, match="both set"):
        MeshSpec.model_validate(
            {"metrics": {"price_per_core_hour": 0.07}, "cost": {"per_core_hour": 0.05}}
        )
