"""Pools of model servers in the spec: where each model is served, how a pool's processes
are named and counted, which replicas a version's clusters list, and who each pool runs as."""

from __future__ import annotations

import re
from typing import Any

import pytest

from servemesh.procs.sandbox import AUTO_GID, AUTO_UID, POOL_UID_FIRST, RunAs, pool_users
from servemesh.proxy.live_plan import PlanRefused, plan_apply
from servemesh.spec import SHARED_POOL, MeshSpec, SpecError, own_pool_name, parse_spec, resolve

TWO_POOLS: dict[str, dict[str, Any]] = {
    "models": {
        "fraud": {},
        "risk": {"pool": "risk", "versions": {"v1": {"source": "demo:3"}}, "traffic": {"v1": 100}},
        "churn": {"pool": "risk", "versions": {"v1": {"source": "demo:4"}}, "traffic": {"v1": 100}},
    },
    "pools": {"risk": {"per_zone": {"zone-a": 2, "zone-b": 1}}},
}


def test_each_model_is_on_a_pool_of_its_own_unless_it_names_one() -> None:
    spec = MeshSpec.model_validate(TWO_POOLS)
    assert spec.pool_names() == ["fraud", "risk"]
    assert spec.pool_of("fraud") == "fraud" and spec.pool_of("churn") == "risk"
    assert spec.pool_models("risk") == ["churn", "risk"]
    models = [(i.name, i.pool) for i in spec.instances() if i.service == "model"]
    assert models == [
        ("model-fraud-zone-a-0", "fraud"), ("model-fraud-zone-b-0", "fraud"),
        ("model-risk-zone-a-0", "risk"), ("model-risk-zone-a-1", "risk"),
        ("model-risk-zone-b-0", "risk"),
    ]  # fmt: skip


def test_the_default_mesh_runs_the_demo_model_on_its_own_pool() -> None:
    spec = MeshSpec()
    assert spec.pool_names() == ["fraud"]
    assert [i.name for i in spec.instances() if i.service == "model"] == [
        "model-fraud-zone-a-0",
        "model-fraud-zone-b-0",
    ]
    # A mesh with no model keeps model servers that load nothing, as before.
    assert MeshSpec(models={}).pool_names() == [SHARED_POOL]


def test_a_models_own_pool_is_its_name_as_a_pool_name_can_hold_it() -> None:
    assert own_pool_name("fraud") == "fraud"
    assert own_pool_name("churn_v2-eu") == "churnv2eu"
    assert own_pool_name("2fast") == "m2fast"
    assert own_pool_name("a-very-long-model-name-indeed") == "averylongmodelna"
    spec = MeshSpec.model_validate(
        {"models": {"wine": {}, "churn_v2": {"versions": {"v1": {}}, "traffic": {"v1": 100}}}}
    )
    assert spec.pool_names() == ["churnv2", "wine"]


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        # Two names that come to one pool name: neither is put on the other's processes.
        ({"churn-a": {}, "churna": {}}, "models.churna.pool: its own pool would be 'churna', "
         "which churn-a already holds; to share it, say so (models.churna.pool: churna)"),
        # A model's own pool is a pool another model names.
        ({"risk": {}, "fraud": {"pool": "risk"}}, "models.risk.pool: its own pool would be "
         "'risk', which a model that names it already holds"),
    ],
)  # fmt: skip
def test_two_models_never_share_a_pool_by_accident(models: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        MeshSpec.model_validate({"models": models})


def test_a_versions_clusters_list_its_pools_servers_only() -> None:
    spec = resolve(MeshSpec.model_validate(TWO_POOLS))
    assert [i.name for i in spec.version_replicas("risk", "v1")] == [
        "model-risk-zone-a-0",
        "model-risk-zone-a-1",
        "model-risk-zone-b-0",
    ]
    assert [i.name for i in spec.version_replicas("fraud", "v1")] == [
        "model-fraud-zone-a-0",
        "model-fraud-zone-b-0",
    ]
    # The scaler's count for one pool leaves every other pool's count alone.
    scaled = spec.model_copy(
        update={
            "fleet": spec.fleet.model_copy(
                update={"model_pools": {"fraud": {"zone-a": 3, "zone-b": 1}}}
            )
        }
    )
    assert len(scaled.version_replicas("fraud", "v1")) == 4
    assert len(scaled.version_replicas("risk", "v1")) == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models: {fraud: {pool: Risk}}", "models.fraud.pool"),
        ("models: {fraud: {pool: risk-1}}", "models.fraud.pool"),
        ("pools: {risk: {}}", "pools.risk: no model is placed on it"),
        (
            "models: {fraud: {pool: risk}}\npools: {risk: {per_zone: {zone-c: 1}}}",
            "pools.risk.per_zone: names unknown zones ['zone-c']",
        ),
        (
            "models: {fraud: {pool: risk}}\npools: {risk: {per_zone: {zone-a: 0}}}",
            "pools.risk.per_zone: needs at least one replica",
        ),
    ],
)
def test_pool_mistakes_are_refused_naming_the_field(text: str, expected: str) -> None:
    with pytest.raises(SpecError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        parse_spec(text, "mesh.yaml")


def test_each_named_pool_runs_as_a_user_of_its_own_the_same_run_after_run() -> None:
    base = RunAs(AUTO_UID, AUTO_GID)
    users = pool_users(base, ["", "risk", "churn", "wine"])
    assert users[""] == base
    named = [users[p] for p in ("risk", "churn", "wine")]
    assert len({u.uid for u in named}) == 3
    assert all(POOL_UID_FIRST <= u.uid < POOL_UID_FIRST + 800 and u.gid == u.uid for u in named)
    assert all(u.groups == (AUTO_GID,) for u in named)
    assert pool_users(base, ["risk", ""])["risk"] == users["risk"]
    assert "--groups=61000" in users["risk"].setpriv_options()
    assert "--clear-groups" in base.setpriv_options()


def test_a_served_model_does_not_move_between_pools_live() -> None:
    running = resolve(MeshSpec.model_validate(TWO_POOLS))
    moved = dict(TWO_POOLS, models={**TWO_POOLS["models"], "churn": {
        "versions": {"v1": {"source": "demo:4"}}, "traffic": {"v1": 100}}})  # fmt: skip
    with pytest.raises(PlanRefused, match="models.churn.pool: risk -> churn"):
        plan_apply(running, MeshSpec.model_validate(moved))


def test_a_running_pools_servers_keep_their_settings_but_its_budget_may_change() -> None:
    running = resolve(MeshSpec.model_validate(TWO_POOLS))
    more = dict(TWO_POOLS, pools={"risk": {"per_zone": {"zone-a": 3, "zone-b": 1}}})
    with pytest.raises(PlanRefused, match=r"pools\.risk\.per_zone\.zone-a: a running pool"):
        plan_apply(running, MeshSpec.model_validate(more))
    # A budget alone would turn the eager pool fraud on demand: that takes a restart.
    budget = dict(TWO_POOLS, pools={**TWO_POOLS["pools"], "fraud": {"memory_budget": "1GiB"}})
    with pytest.raises(PlanRefused, match=r"pools\.fraud\.memory_budget: a running pool"):
        plan_apply(running, MeshSpec.model_validate(budget))
    on_demand = {"risk": {"per_zone": {"zone-a": 2, "zone-b": 1}, "memory_budget": "1GiB"}}
    running = resolve(MeshSpec.model_validate(dict(TWO_POOLS, pools=on_demand)))
    bigger = {"risk": {**on_demand["risk"], "memory_budget": "2GiB"}}
    assert not plan_apply(running, MeshSpec.model_validate(dict(TWO_POOLS, pools=bigger))).adds


def test_two_models_share_a_pool_when_each_says_so() -> None:
    models = {"risk": {"pool": "risk"}, "fraud": {"pool": "risk"}}
    spec = MeshSpec.model_validate({"models": models})
    assert spec.pool_names() == ["risk"] and spec.pool_models("risk") == ["fraud", "risk"]
