"""The rollout's gates on the other change paths (servemesh/rollout/change_gates.py), with a
fixed clock: a freeze refuses naming itself and how to override, an override is recorded
with its reason, only a deploy-like apply asks, and the override flags are checked."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from servemesh.contract.errors import GATE_REFUSED
from servemesh.proxy.live_plan import ApplyPlan, Change
from servemesh.rollout.change_gates import (
    GateRefused,
    enforce,
    models_deployed,
    models_rolled_forward,
    overrides_from,
    read_overrides,
    record_if_overridden,
    weights_deploy,
)
from servemesh.rollout.checklist import OverrideError
from servemesh.spec import MeshSpec, Ports, ResolvedSpec, resolve
from servemesh.spec.rollout_plan import FreezeSpec, FreezeWindow, RolloutSpec

# Saturday 10:00 UTC, inside the weekend freeze below; Wednesday is outside it.
SATURDAY = datetime(2026, 12, 5, 10, 0, tzinfo=UTC)
WEDNESDAY = datetime(2026, 12, 9, 10, 0, tzinfo=UTC)


def frozen_spec(tmp_path: Path) -> ResolvedSpec:
    freeze = FreezeSpec(
        timezone="UTC",
        weekly=[FreezeWindow(start="fri 15:00", end="mon 09:00", reason="weekend freeze")],
    )
    spec = MeshSpec(ports=Ports.free(), state_dir=str(tmp_path), rollout=RolloutSpec(freeze=freeze))
    return resolve(spec)


def test_a_freeze_refuses_naming_itself_and_the_override(tmp_path: Path) -> None:
    spec = frozen_spec(tmp_path)
    with pytest.raises(GateRefused) as refused:
        enforce(spec, ["fraud"], command="routes set fraud", overrides={}, now=SATURDAY)
    said = str(refused.value)
    assert said.startswith("routes set fraud: freeze: inside weekend freeze")
    assert "--override freeze --reason TEXT" in said
    assert "moving traffic back to the version serving the most is never refused" in said
    assert refused.value.exit_code == GATE_REFUSED
    assert read_overrides(tmp_path) == []  # a refusal records nothing


def test_in_a_freeze_a_change_that_deploys_nothing_asks_no_gate(tmp_path: Path) -> None:
    report = enforce(
        frozen_spec(tmp_path), [], command="routes set fraud", overrides={}, now=SATURDAY
    )
    assert report.items == () and report.overridden == []


def test_outside_a_freeze_the_change_passes_and_nothing_is_recorded(tmp_path: Path) -> None:
    report = enforce(
        frozen_spec(tmp_path), ["fraud"], command="routes set fraud", overrides={}, now=WEDNESDAY
    )
    assert [item.name for item in report.items] == ["freeze", "error_budget"]
    assert all(item.ok for item in report.items)
    # No SLO for the model: its budget gate says so, and passes.
    assert report.items[1].detail.startswith("fraud: no SLO for fraud")
    assert report.overridden == [] and read_overrides(tmp_path) == []


def test_an_override_lets_the_change_through_and_is_recorded_with_its_reason(
    tmp_path: Path,
) -> None:
    overrides = overrides_from(["freeze"], ["INC-9 hotfix"])
    report = enforce(
        frozen_spec(tmp_path),
        ["fraud", "wine"],
        command="apply mesh.yaml",
        overrides=overrides,
        now=SATURDAY,
    )
    # Recorded once the change is made, not before (a change that fails records nothing).
    assert read_overrides(tmp_path) == []
    record_if_overridden(tmp_path, report)
    assert report.lines() == [
        "gate overridden: freeze: inside weekend freeze (fri 15:00 -> mon 09:00 UTC) until "
        "Mon 2026-12-07 09:00 UTC (now Sat 2026-12-05 10:00 UTC) (reason: INC-9 hotfix)"
    ]
    [record] = read_overrides(tmp_path)
    assert record["command"] == "apply mesh.yaml" and record["models"] == ["fraud", "wine"]
    assert record["gates"] == [
        {"gate": "freeze", "detail": report.overridden[0].detail, "reason": "INC-9 hotfix"}
    ]
    assert (tmp_path / "gate-overrides.jsonl").stat().st_mode & 0o777 == 0o600
    assert json.loads((tmp_path / "gate-overrides.jsonl").read_text())["who"]


def test_override_flags_are_paired_named_and_given_a_reason() -> None:
    assert overrides_from(None, None) == {}
    with pytest.raises(OverrideError, match="each needs its own --reason"):
        overrides_from(["freeze"], [])
    with pytest.raises(OverrideError, match="'offline_metrics' is no gate of this command"):
        overrides_from(["offline_metrics"], ["why"])
    with pytest.raises(OverrideError, match="--reason for --override freeze: must not be empty"):
        overrides_from(["freeze"], ["  "])


def test_only_what_sends_traffic_somewhere_new_asks_the_gates() -> None:
    target = MeshSpec()
    assert models_deployed(ApplyPlan(target=target)) == []
    quiet = ApplyPlan(
        target=target,
        removed_models=["old"],
        removed_versions=[("fraud", "v0")],
        routing=[Change("~", "policy", "fraud timeout_ms", "1000 -> 2000")],
    )
    assert models_deployed(quiet) == []
    deploys = ApplyPlan(
        target=target,
        added_models=["wine"],
        added_versions=[("wine", "v1"), ("fraud", "v3")],
        weights={
            "lot": ({"v1": 100}, {"v1": 50, "v2": 50}),
            # A bad canary's share given back to the baseline: the way back, not a deploy.
            "churn": ({"v1": 90, "v2": 10}, {"v1": 100, "v2": 0}),
        },
        routing=[Change("~", "shadow", "risk", "off -> v2 (100%)")],
    )
    assert models_deployed(deploys) == ["fraud", "lot", "risk", "wine"]


def test_only_weight_moved_off_the_version_serving_the_most_is_a_deploy() -> None:
    assert weights_deploy({"v1": 90, "v2": 10}, {"v1": 80, "v2": 20})
    assert not weights_deploy({"v1": 90, "v2": 10}, {"v1": 100, "v2": 0})
    assert not weights_deploy({"v1": 100, "v2": 0}, {"v1": 100, "v2": 0})
    # A tie names no baseline: any move is a deploy.
    assert weights_deploy({"v1": 50, "v2": 50}, {"v1": 100, "v2": 0})
    assert weights_deploy({}, {"v1": 100})


def test_a_rollback_that_undoes_a_way_back_deploys(tmp_path: Path) -> None:
    spec = frozen_spec(tmp_path)
    fraud = spec.models["fraud"]
    live = spec.model_copy(
        update={"models": {"fraud": fraud.model_copy(update={"traffic": {"v1": 100, "v2": 0}})}}
    )
    canary = spec.model_copy(
        update={"models": {"fraud": fraud.model_copy(update={"traffic": {"v1": 90, "v2": 10}})}}
    )
    # From 100/0 back to the canary's 90/10: a deploy; from the canary to 100/0: the way back.
    assert models_rolled_forward(live, canary) == ["fraud"]
    assert models_rolled_forward(canary, live) == []
