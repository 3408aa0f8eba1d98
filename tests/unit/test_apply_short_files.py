"""A short `servemesh apply` file over the running spec, and how its plan reads (no network).

The running mesh here has the demo's `fraud` (the shorthand: one input read from `user`)
and `risk`, a model that lists its `inputs`, as a model pushed and applied from the docs
would; neither matches the built-in defaults a file's omitted fields used to take.
"""

from __future__ import annotations

import pytest
from rich.console import Console

from servemesh.cli.apply import plan_table
from servemesh.contract.demo import DEMO_FEATURES
from servemesh.proxy.live_apply import over_running
from servemesh.proxy.live_plan import ApplyPlan, PlanRefused, plan_apply
from servemesh.spec import (
    MeshSpec,
    ModelInputSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    SpecError,
    resolve,
)
from servemesh.spec.policy import EdgeAuth, TrafficSpec

RISK = ModelSpec(
    inputs={"features": ModelInputSpec(view="user", features=list(DEMO_FEATURES))},
    versions={"v1": ModelVersionSpec()},
    traffic={"v1": 100},
)


def _running(**update: object) -> MeshSpec:
    demo = MeshSpec(ports=Ports.free())
    models = {**demo.models, "risk": RISK}
    return resolve(demo.model_copy(update={"models": models, **update}))


RUNNING = _running()


def _plan(text: str, *, prune: bool = False, running: MeshSpec = RUNNING) -> ApplyPlan:
    return plan_apply(running, over_running(text, running, "short.yaml", prune=prune), prune=prune)


@pytest.mark.parametrize(
    "versions", ["{v2: {}}", "{v1: {}, v2: {}}"], ids=["the new one", "old and new"]
)
def test_a_model_that_lists_inputs_takes_a_new_version_from_a_short_file(versions: str) -> None:
    plan = _plan(f"models:\n  risk:\n    versions: {versions}\n")
    assert plan.lines() == ["+ version risk v2"]
    risk = plan.target.models["risk"]
    assert risk.inputs == RISK.inputs and risk.pool == RISK.pool
    assert sorted(risk.versions) == ["v1", "v2"] and risk.traffic == {"v1": 100}
    assert plan.target.models["fraud"] == RUNNING.models["fraud"]


def test_a_short_file_moves_weights_to_the_version_it_adds() -> None:
    plan = _plan("models:\n  risk:\n    versions: {v2: {}}\n    traffic: {v1: 90, v2: 10}\n")
    assert plan.lines() == ["+ version risk v2", "~ weights risk: v1=100 -> v1=90 v2=10"]


def test_a_field_the_file_gives_replaces_the_running_one_and_says_so_when_it_cannot() -> None:
    # The shorthand given for a model that lists inputs: a real change of its inputs.
    with pytest.raises(PlanRefused, match=r"^models\.risk\.(inputs|feature_view|features): "):
        _plan("models:\n  risk:\n    feature_view: user\n")
    # Weights that name a version neither running nor in the file.
    with pytest.raises(SpecError, match=r"models.risk.*names unknown versions \['v3'\]"):
        _plan("models:\n  risk:\n    traffic: {v1: 50, v3: 50}\n")


def test_without_prune_the_versions_a_file_leaves_out_keep_serving() -> None:
    plan = _plan('models:\n  fraud:\n    versions: {v1: {source: "demo:1"}}\n')
    assert not plan.changed and sorted(plan.target.models["fraud"].versions) == ["v1", "v2"]
    pruned = _plan('models:\n  fraud:\n    versions: {v1: {source: "demo:1"}}\n', prune=True)
    assert pruned.removed_models == ["risk"]  # the file's `models:` is the whole set
    assert pruned.removed_versions == [("fraud", "v2"), ("risk", "v1")]
    # v2's weight of 0 goes with it; v1 keeps the traffic the file did not restate.
    assert pruned.target.models["fraud"].traffic == {"v1": 100}


def test_prune_refuses_dropping_a_weighted_version_the_file_moves_no_weight_from() -> None:
    with pytest.raises(PlanRefused) as refused:
        _plan("models:\n  risk:\n    versions: {v2: {}}\n", prune=True)
    assert str(refused.value) == (
        "models.risk.versions.v1: still takes 100% of traffic, and the file gives no "
        "models.risk.traffic to move it; give models.risk.traffic without v1 (e.g. {v2: 100})"
    )


def test_omitted_fields_of_nested_objects_keep_their_running_values() -> None:
    jwt = TrafficSpec(edge_auth=EdgeAuth(mode="jwt"))
    running = _running(traffic=jwt)
    plan = _plan("traffic: {model: {retries: {num_retries: 3}}}\n", running=running)
    assert plan.target.traffic.edge_auth.mode == "jwt"
    assert plan.target.traffic.model.timeout_ms == jwt.model.timeout_ms
    assert plan.lines() == ["~ traffic model.retries.num_retries: 2 -> 3"]


def test_tiers_merge_field_by_field_and_null_turns_them_off() -> None:
    on = _plan("models:\n  fraud:\n    tiers: {cache: {ttl: 1m}}\n")
    assert on.lines() == ["~ tiers fraud: off -> cache ttl 1m, 100000 entries"]
    resized = _plan("models:\n  fraud:\n    tiers: {cache: {max_entries: 5}}\n", running=on.target)
    assert resized.lines() == [
        "~ tiers fraud: cache ttl 1m, 100000 entries -> cache ttl 1m, 5 entries"
    ]
    off = _plan("models:\n  fraud:\n    tiers: null\n", running=on.target)
    assert off.lines() == ["~ tiers fraud: cache ttl 1m, 100000 entries -> off"]


def _table_text(plan: ApplyPlan) -> str:
    console = Console(record=True, width=200)
    console.print(plan_table(plan, "plan"))
    return console.export_text()


def test_the_plan_table_and_the_history_lines_show_every_kind_of_change() -> None:
    text = """
models:
  fraud:
    tiers: {cache: {ttl: 1m}}
    shadow: {version: v2, percent: 50}
    policy: {timeout_ms: 900}
scaling: {enabled: false}
"""
    plan = _plan(text)
    lines = plan.lines()
    assert lines[0] == "~ tiers fraud: off -> cache ttl 1m, 100000 entries"
    assert "~ shadow fraud: off -> v2 (50%)" in lines
    assert "~ policy fraud: traffic.model -> its own" in lines
    assert "~ policy fraud timeout_ms: 0 -> 900" in lines
    assert lines[-1].startswith("~ scaling: ") and lines[-1].endswith(" -> off")
    # Readable lines only: no fragment of the spec's JSON.
    assert not [line for line in lines if '"' in line or line.rstrip().endswith(("{", "}"))]
    table = _table_text(plan)
    for change in plan.changes():
        row = [change.sign + " " + change.kind, change.what, change.detail]
        assert any(all(cell in line for cell in row) for line in table.splitlines()), row
