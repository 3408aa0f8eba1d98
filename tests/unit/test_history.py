"""The routes history survives a crash mid-write, and a rollback puts back only what the
change it undoes touched (never edge users or rate limits). No Envoy: the file and the
pure steps (entries read, fields touched, a spec restored)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from servemesh.proxy.apply import APPLIED, PENDING, RouteManager, _restore, _touched, routing_view
from servemesh.spec import MeshSpec, ModelSpec, ModelVersionSpec, Ports, ResolvedSpec, resolve
from servemesh.state.paths import ApplyError, MeshPaths


def two_models() -> ResolvedSpec:
    versions = {"v1": ModelVersionSpec(source="demo:1"), "v2": ModelVersionSpec(source="demo:2")}
    return resolve(
        MeshSpec(
            ports=Ports.free(),
            models={
                "fraud": ModelSpec(versions=versions, traffic={"v1": 100, "v2": 0}),
                "churn": ModelSpec(versions=versions, traffic={"v1": 100, "v2": 0}),
            },
        )
    )


def entry(entry_id: int, before: ResolvedSpec, after: ResolvedSpec, **extra: Any) -> str:
    return json.dumps(
        {
            "id": entry_id,
            "status": APPLIED,
            "action": f"change {entry_id}",
            "before": routing_view(before),
            "after": routing_view(after),
            **extra,
        }
    )


def with_weights(spec: ResolvedSpec, model: str, weights: dict[str, int]) -> ResolvedSpec:
    models = dict(spec.models)
    models[model] = models[model].model_copy(update={"traffic": weights})
    return spec.model_copy(update={"models": models})


def test_a_torn_or_garbage_line_is_skipped_with_a_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = two_models()
    changed = with_weights(spec, "fraud", {"v1": 50, "v2": 50})
    manager = RouteManager(MeshPaths(tmp_path))
    manager.paths.history.write_text(
        entry(1, spec, changed)
        + "\nnot json at all\n"
        + '["a list", "not an entry"]\n'
        + entry(2, changed, spec)[:40]  # a crash mid-write: the line is cut, no newline
    )
    with caplog.at_level(logging.WARNING, logger="servemesh.proxy.apply"):
        history = manager.history()
    assert [e["id"] for e in history] == [1]
    warned = [r.getMessage() for r in caplog.records]
    assert any("line 2" in m for m in warned) and any("line 3" in m for m in warned)
    assert any("line 4" in m for m in warned)


def test_an_append_after_a_torn_line_starts_a_line_of_its_own(tmp_path: Path) -> None:
    spec = two_models()
    manager = RouteManager(MeshPaths(tmp_path))
    manager.paths.history.write_text(entry(1, spec, spec) + "\n" + '{"id": 2, "sta')
    pending = manager._begin_entry("set fraud", "ops", spec, spec, ["x"], "42")
    assert pending["id"] == 2  # the torn line named no id the reader could trust
    manager._finish_entry(pending, APPLIED, 0.01)
    history = manager.history()
    assert [(e["id"], e["status"]) for e in history] == [(1, APPLIED), (2, APPLIED)]
    assert history[-1]["apply_ms"] == 10.0


def test_the_last_line_of_an_id_wins_and_a_crash_leaves_it_pending(tmp_path: Path) -> None:
    spec = two_models()
    manager = RouteManager(MeshPaths(tmp_path))
    first = manager._begin_entry("set fraud", "ops", spec, spec, ["x"], "1")
    manager._finish_entry(first, APPLIED, 0.002)
    manager._begin_entry("set churn", "ops", spec, spec, ["y"], "2")  # then a crash
    history = manager.history()
    assert [(e["id"], e["status"]) for e in history] == [(1, APPLIED), (2, PENDING)]


def test_old_entries_without_a_status_count_as_applied(tmp_path: Path) -> None:
    spec = two_models()
    manager = RouteManager(MeshPaths(tmp_path))
    line = json.loads(entry(1, spec, spec))
    del line["status"]
    manager.paths.history.write_text(json.dumps(line) + "\n")
    assert manager.history()[0]["status"] == APPLIED


def test_rollback_with_nothing_applied_is_refused(tmp_path: Path) -> None:
    spec = two_models()
    manager = RouteManager(MeshPaths(tmp_path))
    manager._begin_entry("set fraud", "ops", spec, spec, ["x"], "1")  # pending only
    with pytest.raises(ApplyError, match="nothing to roll back"):
        manager.rollback()


def test_a_change_touches_only_the_fields_it_changed() -> None:
    spec = two_models()
    changed = with_weights(spec, "fraud", {"v1": 50, "v2": 50})
    touched = _touched(json.loads(entry(1, spec, changed)))
    assert touched == {("models", "fraud", "traffic")}


def test_edge_users_and_rate_limits_are_never_touched() -> None:
    spec = two_models()
    traffic = spec.traffic.model_copy(
        update={
            "rate_limit": spec.traffic.rate_limit.model_copy(update={"requests_per_second": 7}),
            "edge_auth": spec.traffic.edge_auth.model_copy(update={"enabled": True}),
        }
    )
    changed = spec.model_copy(update={"traffic": traffic})
    assert _touched(json.loads(entry(1, spec, changed))) == set()


def test_rollback_restores_what_the_change_touched_and_keeps_the_rest_live() -> None:
    spec = two_models()
    # Change #1 moved fraud; since then churn moved (out of band) and the rate limit too.
    changed = with_weights(spec, "fraud", {"v1": 50, "v2": 50})
    live = with_weights(changed, "churn", {"v1": 0, "v2": 100})
    live = live.model_copy(
        update={
            "traffic": live.traffic.model_copy(
                update={"rate_limit": live.traffic.rate_limit.model_copy(update={"burst": 9})}
            )
        }
    )
    one = json.loads(entry(1, spec, changed))
    restored = _restore(live, one["before"], _touched(one))
    assert restored.models["fraud"].traffic == {"v1": 100, "v2": 0}
    assert restored.models["churn"].traffic == {"v1": 0, "v2": 100}  # not #1's to undo
    assert restored.traffic.rate_limit.burst == 9  # never rolled back
