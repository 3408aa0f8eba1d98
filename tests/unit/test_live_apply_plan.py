"""What `servemesh apply` may change live, and how it refuses the rest (no network)."""

from __future__ import annotations

import pytest

from servemesh.contract.demo import DEMO_FEATURES
from servemesh.proxy.live_apply import _keeping_removed, over_running, resolved_target
from servemesh.proxy.live_plan import ApplyPlan, PlanRefused, first_difference, plan_apply
from servemesh.spec import (
    FeatureViewSpec,
    MeshSpec,
    Ports,
    Replicas,
    SpecError,
    parse_spec,
    resolve,
)

# The demo mesh: fraud v1 (100) and v2 (0), reading the `user` view.
RUNNING = resolve(MeshSpec(ports=Ports.free()))

FRAUD = """
models:
  fraud:
    versions: {v1: {source: "demo:1"}, v2: {source: "demo:2"}%s}
    traffic: %s
"""


def _fraud(extra_versions: str = "", traffic: str = "{v1: 100, v2: 0}") -> str:
    return FRAUD % (extra_versions, traffic)


def _plan(text: str, *, prune: bool = False, running: MeshSpec = RUNNING) -> ApplyPlan:
    return plan_apply(running, parse_spec(text, "mesh.yaml"), prune=prune)


def _refusal(text: str, *, prune: bool = False) -> str:
    with pytest.raises(PlanRefused) as refused:
        _plan(text, prune=prune)
    return str(refused.value)


def test_the_running_spec_itself_changes_nothing() -> None:
    plan = _plan(_fraud())
    assert not plan.changed and plan.lines() == []


def test_a_new_version_with_weight_is_added_and_its_weights_shown() -> None:
    plan = _plan(_fraud(", v3: {}", "{v1: 90, v2: 0, v3: 10}"))
    assert plan.added_versions == [("fraud", "v3")]
    assert plan.removed_versions == [] and plan.added_models == []
    assert plan.lines() == [
        "+ version fraud v3",
        "~ weights fraud: v1=100 v2=0 -> v1=90 v2=0 v3=10",
    ]
    # Kept versions keep where they were seeded from; the new one comes from the registry.
    assert plan.target.models["fraud"].versions["v1"].source == "demo:1"
    assert plan.target.models["fraud"].versions["v3"].source == "registry"


def test_a_new_model_and_view_are_added_and_what_the_file_leaves_out_keeps_running() -> None:
    text = """
feature_views:
  lot: {features: [alcohol, malic_acid, ash], max_age: 30d}
models:
  wine:
    feature_view: lot
    features: [alcohol, malic_acid, ash]
    versions: {v1: {}}
    traffic: {v1: 100}
"""
    plan = _plan(text)
    assert plan.added_models == ["wine"] and plan.added_versions == [("wine", "v1")]
    assert plan.added_views == ["lot"]
    assert plan.kept_models == ["fraud"] and plan.kept_views == ["user"]
    assert sorted(plan.target.models) == ["fraud", "wine"]
    assert sorted(plan.target.feature_views) == ["lot", "user"]


def test_prune_removes_models_and_views_the_file_leaves_out() -> None:
    text = """
feature_views:
  lot: {features: [a]}
models:
  wine: {feature_view: lot, features: [a], versions: {v1: {}}, traffic: {v1: 100}}
"""
    plan = _plan(text, prune=True)
    assert plan.removed_models == ["fraud"]
    assert plan.removed_versions == [("fraud", "v1"), ("fraud", "v2")]
    assert plan.removed_views == ["user"]
    assert sorted(plan.target.models) == ["wine"]


def test_removing_a_version_without_weight_is_allowed() -> None:
    plan = _plan(
        """
models:
  fraud:
    versions: {v1: {source: "demo:1"}}
    traffic: {v1: 100}
"""
    )
    assert plan.removed_versions == [("fraud", "v2")] and plan.removes and not plan.adds
    assert plan.lines() == ["- version fraud v2"]  # its weight was 0: no traffic moves


def test_removing_a_weighted_version_is_refused_with_the_command_that_moves_its_weight() -> None:
    text = """
models:
  fraud:
    versions: {v2: {source: "demo:2"}}
    traffic: {v2: 100}
"""
    assert _refusal(text) == (
        "models.fraud.versions.v1: still takes 100% of traffic; move its weight first: "
        "servemesh routes set fraud v2=100"
    )


def test_removing_the_shadow_target_is_refused() -> None:
    running = resolve(
        parse_spec(
            _fraud().replace("traffic:", "shadow: {version: v2}\n    traffic:")
            + "ports: {edge: 0, mesh: 0, envoy_admin: 0, services_base: 0}\n"
        )
    )
    with pytest.raises(PlanRefused) as refused:
        _plan(
            'models:\n  fraud:\n    versions: {v1: {source: "demo:1"}}\n    traffic: {v1: 100}\n',
            running=running,
        )
    assert str(refused.value).startswith("models.fraud.versions.v2: is the shadow target")
    assert "servemesh routes shadow fraud --off" in str(refused.value)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (
            _fraud().replace("traffic:", "batching: {max_batch_size: 8}\n    traffic:"),
            "models.fraud.batching.max_batch_size",
        ),
        (
            _fraud().replace("traffic:", f"features: [{DEMO_FEATURES[0]}]\n    traffic:"),
            "models.fraud.features",
        ),
        (
            _fraud("").replace('v2: {source: "demo:2"}', "v2: {inject_latency_ms: 5}"),
            "models.fraud.versions.v2.inject_latency_ms",
        ),
        (
            "zones: [zone-a]\ngateway: {per_zone: {zone-a: 1}}\nfeature: {per_zone: {zone-a: 1}}\n"
            "model_servers: {per_zone: {zone-a: 1}}\n",
            "zones",
        ),
        ("model_servers: {per_zone: {zone-a: 2, zone-b: 1}}\n", "model_servers.per_zone.zone-a"),
        ("limits: {max_message_bytes: 2048}\n", "limits.max_message_bytes"),
        (
            f"feature_views:\n  user: {{features: [{', '.join(DEMO_FEATURES)}], max_age: 1d}}\n",
            "feature_views.user.max_age",
        ),
    ],
)
def test_what_cannot_change_live_is_refused_naming_the_field(text: str, field: str) -> None:
    assert _refusal(text).startswith(f"{field}: ")


def test_a_view_a_model_reads_cannot_go() -> None:
    # A file that keeps the model but drops its view is no valid spec at all ...
    with pytest.raises(SpecError, match="models.fraud.feature_view: 'user' is not one of"):
        parse_spec("feature_views:\n  other: {features: [a]}\n" + _fraud())
    # ... and the plan checks the mesh it would run too (models the file leaves out stay).
    running = RUNNING.model_copy(
        update={"feature_views": {**RUNNING.feature_views, "other": FeatureViewSpec()}}
    )
    plan = _plan(_fraud(), prune=True, running=running)
    assert plan.removed_views == ["other"] and plan.removed_models == []


def test_ports_and_the_state_dir_are_the_running_mesh_s_own() -> None:
    plan = _plan(_fraud() + "ports: {edge: 1234}\nstate_dir: elsewhere\n")
    assert not plan.changed


def test_a_fallback_score_and_policy_change_live() -> None:
    text = _fraud().replace("traffic:", "fallback_score: 0.5\n    traffic:")
    plan = _plan(text)
    assert plan.fallback == {"fraud": (None, 0.5)}
    assert plan.lines() == ["~ fallback_score fraud: None -> 0.5"]


def test_keeping_a_model_s_feature_values_in_the_log_changes_live() -> None:
    plan = _plan(_fraud().replace("traffic:", "log_features: true\n    traffic:"))
    assert plan.changed and not plan.adds and not plan.removes
    assert plan.log_features == {"fraud": (False, True)}
    assert plan.lines() == ["~ log_features fraud: False -> True"]
    assert plan.target.models["fraud"].log_features


def test_a_model_s_tiers_change_live() -> None:
    tiers = "tiers: {precomputed: {from: redis, max_age: 2h}, cache: {ttl: 1m}}"
    plan = _plan(_fraud().replace("traffic:", f"{tiers}\n    traffic:"))
    assert plan.changed and not plan.adds and not plan.removes
    assert plan.lines() == [
        "~ tiers fraud: off -> precomputed from redis, max_age 2h; cache ttl 1m, 100000 entries"
    ]
    target = plan.target.models["fraud"].tiers
    assert target is not None and target.cache is not None and target.cache.ttl == "1m"
    off = plan_apply(plan.target, parse_spec(_fraud(), "mesh.yaml"))
    assert off.lines() == [
        "~ tiers fraud: precomputed from redis, max_age 2h; cache ttl 1m, 100000 entries -> off"
    ]


def test_the_gateways_coalescing_changes_live_and_reaches_the_resolved_spec() -> None:
    plan = _plan(_fraud() + "coalescing: {enabled: true, max_rows: 16}\n")
    assert plan.changed and not plan.adds and not plan.removes
    assert plan.lines() == ["~ coalescing: on, max_rows 64 -> on, max_rows 16"]
    assert resolved_target(RUNNING, plan.target).coalescing.max_rows == 16
    off = _plan(_fraud() + "coalescing: {enabled: false}\n")
    assert off.lines() == ["~ coalescing: on, max_rows 64 -> off"]
    assert not resolved_target(RUNNING, off.target).coalescing.enabled
    # The running mesh's own coalescing, written out, changes nothing.
    assert not _plan(_fraud() + "coalescing: {enabled: true, max_rows: 64}\n").changed


def test_request_logs_change_live() -> None:
    plan = _plan(_fraud() + "logs: {requests: true}\n")
    assert plan.lines() == ["~ logs: refusals and failures only -> a line per request"]
    assert resolved_target(RUNNING, plan.target).logs.requests


def test_a_mixed_change_first_serves_both_old_and_new() -> None:
    """Adding v3 and removing v2 in one apply: the first Envoy step keeps v2 (weight 0)."""
    plan = _plan(
        'models:\n  fraud:\n    versions: {v1: {source: "demo:1"}, v3: {}}\n'
        "    traffic: {v1: 100, v3: 0}\n"
    )
    assert plan.adds and plan.removes
    union = resolved_target(RUNNING, _keeping_removed(plan, RUNNING))
    assert sorted(union.models["fraud"].versions) == ["v1", "v2", "v3"]
    assert union.instance_ports == RUNNING.instance_ports
    final = resolved_target(RUNNING, plan.target)
    assert sorted(final.models["fraud"].versions) == ["v1", "v3"]


def test_first_difference_names_the_deepest_field() -> None:
    assert first_difference({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}, "x") == "x.a.c"
    assert first_difference({"a": 1}, {"a": 1, "b": 2}, "x") == "x.b"
    assert first_difference([1], [1], "x") is None


def _one_zone() -> MeshSpec:
    one = {"zone-a": 1}
    return resolve(
        MeshSpec(
            ports=Ports.free(),
            zones=["zone-a"],
            gateway=Replicas(per_zone=one),
            feature=Replicas(per_zone=one),
            model_servers=Replicas(per_zone=one),
            models={},
            feature_views={},
        )
    )


def test_sections_a_file_leaves_out_are_the_running_mesh_s() -> None:
    """A file of `models:` and `feature_views:` applies to a mesh of any shape, not only to
    one matching the built-in defaults (two zones, the demo model)."""
    running = _one_zone()
    text = """
feature_views:
  lot: {features: [alcohol, malic_acid, ash]}
models:
  wine:
    feature_view: lot
    features: [alcohol, malic_acid, ash]
    versions: {v1: {}}
    traffic: {v1: 100}
"""
    with pytest.raises(PlanRefused, match="^zones: "):
        _plan(text, running=running)  # read alone, the file means two zones
    plan = plan_apply(running, over_running(text, running, "mesh.yaml"))
    assert plan.added_models == ["wine"] and plan.added_views == ["lot"]
    assert plan.target.zones == ["zone-a"]


def test_without_prune_a_file_may_declare_only_what_it_adds() -> None:
    text = "feature_views:\n  lot: {features: [a]}\n"
    plan = plan_apply(RUNNING, over_running(text, RUNNING))
    assert plan.added_views == ["lot"] and not plan.removes
    assert sorted(plan.target.feature_views) == ["lot", "user"]


def test_with_prune_a_view_a_model_reads_cannot_go() -> None:
    text = "feature_views:\n  lot: {features: [a]}\n"
    with pytest.raises(SpecError, match="models.fraud.feature_view: 'user' is not one of"):
        over_running(text, RUNNING, "mesh.yaml", prune=True)


def test_a_resolved_file_is_taken_whole_and_bad_yaml_named() -> None:
    from servemesh.spec import dump_spec

    assert over_running(dump_spec(RUNNING), RUNNING) == RUNNING
    with pytest.raises(SpecError, match="malformed YAML"):
        over_running("models: [\n", RUNNING, "mesh.yaml")
    with pytest.raises(SpecError, match=r"mesh.yaml: models.fraud.*weights must sum to 100"):
        over_running("models:\n  fraud:\n    traffic: {v1: 70}\n", RUNNING, "mesh.yaml")
