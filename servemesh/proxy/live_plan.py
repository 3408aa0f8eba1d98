"""What `servemesh apply FILE` may change in a running mesh, decided without a network.

`plan_apply(running, declared, prune=...)` compares the file's declared spec with the
running one and answers the plan (models, versions and feature views added or removed,
weights and fallback scores changed, and the spec the mesh will run), or refuses with one
line naming the field and what to do instead.

Allowed live: routing and policy (`traffic`, `models.*.traffic|shadow|policy`), models added
(removed only with `--prune`; without it a model the file leaves out keeps running),
versions added and removed, feature views added (removed only with `--prune`, and never
while a model reads them), a model's `fallback_score`, `tiers` and `log_features`, the gateways'
`coalescing` and the services' `logs` (each service follows them on its next look at the
spec). Everything else describes processes or what a served version computes: zones,
replicas, ports and limits need a restart; a served version's inputs, features or batching
change only as a new version.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from servemesh.contract.errors import ServemeshError
from servemesh.spec import (
    CoalescingSpec,
    LogsSpec,
    MeshSpec,
    ModelSpec,
    PoolSpec,
    TiersSpec,
    own_pool_name,
)
from servemesh.spec import declared as declared_part
from servemesh.spec.policy import ShadowSpec
from servemesh.spec.scaling_policy import ScalingSpec

Key = tuple[str, str]

# Top-level fields a live apply may change (the rest describe processes).
# `scaling`: the scaler reads the running spec every round.
# `pools`: a pool's servers per zone change like the scaler's counts (the launcher starts
# and stops them); a new pool's servers start and load its models from the spec.
LIVE_TOP = {"models", "feature_views", "traffic", "coalescing", "logs", "scaling", "pools"}
# Resolved by the launcher (or set by `up --netns`): a file usually leaves them out, and the
# running mesh keeps its own, as `routes apply` does.
IGNORED_TOP = {"ports", "state_dir", "feature_store", "demo", "network"}
# Per model: what may change while its versions serve.
# `tiers`: each gateway follows them (a cache dropped or resized); the answers they keep
# are keyed by version, so no served version computes anything else.
# `log_features`: what the gateways' prediction log keeps of a call, not what it computes.
LIVE_MODEL = {"traffic", "shadow", "policy", "versions", "fallback_score", "tiers", "log_features"}
# Per version: where it was seeded from is history, not what it computes.
IGNORED_VERSION = {"source"}


class PlanRefused(ServemeshError, ValueError):
    """The file asks for a change a running mesh cannot take; one line names the field."""

    label = "refused"


@dataclass(frozen=True)
class Change:
    """One change of a plan, as the plan table shows it and the history records it."""

    sign: str  # `+` added, `-` removed, `~` changed
    kind: str  # model, version, feature view, weights, tiers, policy, ...
    what: str = ""  # the model, version or view; empty for a mesh-wide setting
    detail: str = ""  # "before -> after"

    @property
    def line(self) -> str:
        head = f"{self.sign} {self.kind}" + (f" {self.what}" if self.what else "")
        return f"{head}: {self.detail}" if self.detail else head


@dataclass(frozen=True)
class ApplyPlan:
    """What an apply changes, and the declared spec the mesh runs afterwards."""

    target: MeshSpec
    added_models: list[str] = field(default_factory=list)
    removed_models: list[str] = field(default_factory=list)
    # Models the file leaves out that keep running (no --prune).
    kept_models: list[str] = field(default_factory=list)
    # Every version to load, those of added models included.
    added_versions: list[Key] = field(default_factory=list)
    # Every version to stop serving, those of removed models included.
    removed_versions: list[Key] = field(default_factory=list)
    added_views: list[str] = field(default_factory=list)
    removed_views: list[str] = field(default_factory=list)
    kept_views: list[str] = field(default_factory=list)
    # model -> (weights before, weights after), for models whose weights change.
    weights: dict[str, tuple[dict[str, int], dict[str, int]]] = field(default_factory=dict)
    # model -> (before, after), for kept models whose fallback score changes.
    fallback: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    # model -> (before, after), for kept models whose tiers change.
    tiers: dict[str, tuple[TiersSpec | None, TiersSpec | None]] = field(default_factory=dict)
    # model -> (before, after), for kept models whose log_features changes.
    log_features: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    # True when routing or policy changes beyond weights (shadow, policy, mesh traffic).
    routing_changed: bool = False
    # What of it changes, readably: a model's shadow, each field of a model's policy or of
    # the mesh's `traffic` that changes.
    routing: list[Change] = field(default_factory=list)
    # (before, after) when the gateways' coalescing changes.
    coalescing: tuple[CoalescingSpec, CoalescingSpec] | None = None
    # (before, after) when what the services log changes.
    logs: tuple[LogsSpec, LogsSpec] | None = None
    # (before, after) when the scaler's policy changes.
    scaling: tuple[ScalingSpec, ScalingSpec] | None = None

    @property
    def adds(self) -> bool:
        return bool(self.added_versions or self.added_views)

    @property
    def removes(self) -> bool:
        return bool(self.removed_versions or self.removed_views)

    @property
    def changed(self) -> bool:
        return bool(
            self.adds
            or self.removes
            or self.weights
            or self.fallback
            or self.tiers
            or self.log_features
            or self.routing_changed
            or self.coalescing
            or self.logs
            or self.scaling
        )

    def changes(self) -> list[Change]:
        """Every change, in the order the plan table and the history show them."""
        found: list[Change] = []
        found += [Change("+", "model", m) for m in self.added_models]
        found += [Change("-", "model", m) for m in self.removed_models]
        found += [Change("+", "version", f"{m} {v}") for m, v in self.added_versions]
        found += [Change("-", "version", f"{m} {v}") for m, v in self.removed_versions]
        found += [Change("+", "feature view", v) for v in self.added_views]
        found += [Change("-", "feature view", v) for v in self.removed_views]
        for model, (before, after) in sorted(self.weights.items()):
            found.append(
                Change("~", "weights", model, f"{_weights(before) or '-'} -> {_weights(after)}")
            )
        for model, (old, new) in sorted(self.fallback.items()):
            found.append(Change("~", "fallback_score", model, f"{old} -> {new}"))
        for model, (was, now) in sorted(self.tiers.items()):
            found.append(Change("~", "tiers", model, f"{tiers_text(was)} -> {tiers_text(now)}"))
        for model, (logged, logs) in sorted(self.log_features.items()):
            found.append(Change("~", "log_features", model, f"{logged} -> {logs}"))
        found += self.routing
        if self.coalescing is not None:
            before_text, after_text = (coalescing_text(c) for c in self.coalescing)
            found.append(Change("~", "coalescing", detail=f"{before_text} -> {after_text}"))
        if self.logs is not None:
            before_text, after_text = (logs_text(c) for c in self.logs)
            found.append(Change("~", "logs", detail=f"{before_text} -> {after_text}"))
        if self.scaling is not None:
            before_text, after_text = (scaling_text(c) for c in self.scaling)
            found.append(Change("~", "scaling", detail=f"{before_text} -> {after_text}"))
        return found

    def lines(self) -> list[str]:
        """One line per change, `+` added, `-` removed, `~` changed (history and output)."""
        return [change.line for change in self.changes()]


def scaling_text(scaling: ScalingSpec) -> str:
    if not scaling.enabled:
        return "off"
    parts = []
    for what, pool in (
        ("model servers", scaling.model_servers),
        ("gateways", scaling.gateway),
        ("feature services", scaling.feature),
    ):
        floors = len(pool.schedule.floors)
        parts.append(
            f"{what} {pool.min}..{pool.max} per zone"
            + (f", standby {pool.standby}" if pool.standby else "")
            + (f", {floors} schedule floor{'s' * (floors != 1)}" if floors else "")
        )
    return "; ".join(parts)


def tiers_text(tiers: TiersSpec | None) -> str:
    parts = []
    if tiers is not None and tiers.precomputed is not None:
        found = tiers.precomputed
        parts.append(f"precomputed from {found.source}, max_age {found.max_age}")
    if tiers is not None and tiers.cache is not None:
        parts.append(f"cache ttl {tiers.cache.ttl}, {tiers.cache.max_entries} entries")
    return "; ".join(parts) or "off"


def shadow_text(shadow: ShadowSpec | None) -> str:
    return "off" if shadow is None else f"{shadow.version} ({shadow.percent:g}%)"


def value_text(where: str, value: Any) -> str:
    """A spec value as a change line shows it."""
    if value is None:
        return "none"
    if where.rsplit(".", 1)[-1] == "users" and isinstance(value, list):
        # htpasswd lines: the history says how many, never their hashes.
        return f"{len(value)} user{'s' * (len(value) != 1)}"
    return value if isinstance(value, str) else json.dumps(value)


def leaf_changes(before: Any, after: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, before, after) for every place two plain-data trees differ; a field
    one side lacks counts as None there."""
    if isinstance(before, dict) and isinstance(after, dict):
        found: list[tuple[str, Any, Any]] = []
        for key in [*before, *(k for k in after if k not in before)]:
            where = f"{path}.{key}" if path else str(key)
            found += leaf_changes(before.get(key), after.get(key), where)
        return found
    return [] if before == after else [(path, before, after)]


def _leaf_change(kind: str, what: str, where: str, before: Any, after: Any) -> Change:
    return Change("~", kind, what, f"{value_text(where, before)} -> {value_text(where, after)}")


def routing_changes(running: MeshSpec, declared: MeshSpec, models: list[str]) -> list[Change]:
    """The routing and policy a plan changes, one line per field: the mesh's `traffic`, and
    the shadow and policy of `models` (those both specs serve)."""
    before = running.traffic.model_dump(mode="json")
    after = declared.traffic.model_dump(mode="json")
    found = [_leaf_change("traffic", w, w, a, b) for w, a, b in leaf_changes(before, after)]
    for name in models:
        live, wanted = running.models[name], declared.models[name]
        if live.shadow != wanted.shadow:
            shadows = f"{shadow_text(live.shadow)} -> {shadow_text(wanted.shadow)}"
            found.append(Change("~", "shadow", name, shadows))
        if live.policy != wanted.policy:
            found += _policy_changes(name, live, wanted, running, declared)
    return found


def _policy_changes(
    name: str, live: ModelSpec, wanted: ModelSpec, running: MeshSpec, declared: MeshSpec
) -> list[Change]:
    """A model's own policy overrides the mesh's `traffic.model`: its fields are shown
    against the policy the model follows before and after."""
    found = []
    if (live.policy is None) != (wanted.policy is None):
        moved = "traffic.model -> its own" if live.policy is None else "its own -> traffic.model"
        found.append(Change("~", "policy", name, moved))
    before = (live.policy or running.traffic.model).model_dump(mode="json")
    after = (wanted.policy or declared.traffic.model).model_dump(mode="json")
    for where, old, new in leaf_changes(before, after):
        found.append(_leaf_change("policy", f"{name} {where}", where, old, new))
    return found


def logs_text(logs: LogsSpec) -> str:
    return "a line per request" if logs.requests else "refusals and failures only"


def coalescing_text(coalescing: CoalescingSpec) -> str:
    if not coalescing.enabled:
        return "off"
    return f"on, max_rows {coalescing.max_rows}"


def natural_version_order(version: str) -> tuple[object, ...]:
    """Sort key under which v10 comes after v9."""
    parts = re.split(r"(\d+)", version)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def _carrying(weights: dict[str, int]) -> dict[str, int]:
    return {version: weight for version, weight in weights.items() if weight}


def _weights(weights: dict[str, int]) -> str:
    return " ".join(f"{v}={w}" for v, w in sorted(weights.items(), key=lambda i: i[0]))


def first_difference(before: Any, after: Any, path: str) -> str | None:
    """The dotted path of the first place two plain-data trees differ; None when equal."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in [*before, *(k for k in after if k not in before)]:
            if key not in before or key not in after:
                return f"{path}.{key}"
            found = first_difference(before[key], after[key], f"{path}.{key}")
            if found:
                return found
        return None
    return None if before == after else path


def views_read_by(model: ModelSpec) -> set[str]:
    """The feature views a model reads (its `inputs`, or the shorthand's `feature_view`)."""
    return set(model.views)


def _model_fixed(model: ModelSpec) -> dict[str, Any]:
    data = model.model_dump(mode="json")
    # The pool is compared as placed (`pool: fraud` and no pool are one for model fraud).
    return {k: v for k, v in data.items() if k not in LIVE_MODEL and k != "pool"}


def _version_fixed(model: ModelSpec, version: str) -> dict[str, Any]:
    data = model.versions[version].model_dump(mode="json")
    return {k: v for k, v in data.items() if k not in IGNORED_VERSION}


def _routing_of(spec: MeshSpec, name: str) -> dict[str, Any]:
    model = spec.models[name]
    return {
        "shadow": model.shadow.model_dump(mode="json") if model.shadow else None,
        "policy": model.policy.model_dump(mode="json") if model.policy else None,
    }


def weight_suggestion(live: ModelSpec, declared: ModelSpec | None, leaving: str) -> str:
    """VERSION=WEIGHT pairs that move all traffic off `leaving` (for a refusal's hint)."""
    staying = [
        v for v in live.versions if v != leaving and (declared is None or v in declared.versions)
    ]
    if not staying:
        staying = [v for v in live.versions if v != leaving]
    if declared is not None:
        wanted = {v: declared.traffic.get(v, 0) for v in staying}
        if sum(wanted.values()) == 100:
            return _weights({v: w for v, w in wanted.items() if w} or wanted)
    if not staying:
        return "<another version>=100"
    best = max(staying, key=lambda v: (live.traffic.get(v, 0), natural_version_order(v)))
    return f"{best}=100"


def _check_fixed_top(running: MeshSpec, declared: MeshSpec) -> None:
    before = running.model_dump(mode="json")
    after = declared.model_dump(mode="json")
    for key in before:
        if key in LIVE_TOP or key in IGNORED_TOP:
            continue
        where = first_difference(before[key], after.get(key), key)
        if where:
            raise PlanRefused(
                f"{where}: differs from the running mesh; processes, ports, zones and limits "
                "change only with a restart (servemesh up)"
            )


def _check_running_pools(running: MeshSpec, declared: MeshSpec) -> None:
    """A pool that runs keeps how many servers it started with and how they load (its
    processes were started so); its memory budget may change live (each server follows the
    spec). A new pool's settings come with it."""
    default = PoolSpec()
    for pool in running.pool_names():
        if pool not in declared.pool_names():
            continue
        before, after = (
            spec.pools.get(pool, default).model_dump(mode="json", exclude={"memory_budget"})
            for spec in (running, declared)
        )
        where = first_difference(before, after, f"pools.{pool}")
        loads = [spec.pools.get(pool, default).on_demand for spec in (running, declared)]
        if where is None and loads[0] != loads[1]:
            where = f"pools.{pool}.memory_budget"  # a budget alone turns a pool on demand
        if where:
            raise PlanRefused(
                f"{where}: a running pool's servers change only with a restart of the mesh "
                "(servemesh up), or by the scaler; its memory_budget may change live"
            )


def _plan_versions(
    name: str, live: ModelSpec, wanted: ModelSpec, plan: dict[str, list[Key]]
) -> None:
    live_pool, wanted_pool = (spec.pool or own_pool_name(name) for spec in (live, wanted))
    if live_pool != wanted_pool:
        raise PlanRefused(
            f"models.{name}.pool: {live_pool} -> {wanted_pool}: a served model does not move "
            "between pools "
            "live; add it under a new name on the new pool, move the traffic there, then drop "
            "the old one (or restart the mesh)"
        )
    fixed_before, fixed_after = _model_fixed(live), _model_fixed(wanted)
    where = first_difference(fixed_before, fixed_after, f"models.{name}")
    if where:
        served = ", ".join(sorted(live.versions, key=natural_version_order))
        raise PlanRefused(
            f"{where}: changes how the versions already served ({served}) take their inputs "
            "or batch; push a new version (or a new model) with it and move traffic there"
        )
    for version in wanted.versions:
        if version not in live.versions:
            plan["added"].append((name, version))
            continue
        where = first_difference(
            _version_fixed(live, version),
            _version_fixed(wanted, version),
            f"models.{name}.versions.{version}",
        )
        if where:
            raise PlanRefused(
                f"{where}: changes a version already served; push a new version instead"
            )
    for version in live.versions:
        if version not in wanted.versions:
            refuse_removal(name, version, live, wanted)
            plan["removed"].append((name, version))


def refuse_removal(name: str, version: str, live: ModelSpec, declared: ModelSpec | None) -> None:
    """Refuse removing a version that takes traffic or is the shadow target."""
    weight = live.traffic.get(version, 0)
    if weight > 0:
        raise PlanRefused(
            f"models.{name}.versions.{version}: still takes {weight}% of traffic; move its "
            f"weight first: servemesh routes set {name} "
            f"{weight_suggestion(live, declared, version)}"
        )
    if live.shadow is not None and live.shadow.version == version:
        raise PlanRefused(
            f"models.{name}.versions.{version}: is the shadow target of {name}; turn the "
            f"shadow off first: servemesh routes shadow {name} --off"
        )


def plan_apply(running: MeshSpec, declared: MeshSpec, *, prune: bool = False) -> ApplyPlan:
    """The plan that makes the running mesh match `declared` (a declared spec, without the
    running mesh's ports); raises PlanRefused naming the field when it cannot be live."""
    running = declared_part(running)
    declared = declared_part(declared)
    _check_fixed_top(running, declared)
    _check_running_pools(running, declared)

    models: dict[str, ModelSpec] = {}
    added_models: list[str] = []
    removed_models: list[str] = []
    kept_models: list[str] = []
    versions: dict[str, list[Key]] = {"added": [], "removed": []}
    weights: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
    fallback: dict[str, tuple[float | None, float | None]] = {}
    tiers: dict[str, tuple[TiersSpec | None, TiersSpec | None]] = {}
    log_features: dict[str, tuple[bool, bool]] = {}
    routing_changed = running.traffic != declared.traffic
    served_by_both: list[str] = []

    for name, live in running.models.items():
        wanted = declared.models.get(name)
        if wanted is None:
            if prune:
                removed_models.append(name)
                versions["removed"] += [(name, v) for v in live.versions]
            else:
                kept_models.append(name)
                models[name] = live
            continue
        _plan_versions(name, live, wanted, versions)
        # Kept versions keep the running entry (where it was seeded from, for one).
        kept = {v: live.versions.get(v, spec) for v, spec in wanted.versions.items()}
        models[name] = wanted.model_copy(update={"versions": kept})
        # A version leaving with weight 0 (or coming with it) moves no traffic.
        if _carrying(live.traffic) != _carrying(wanted.traffic):
            weights[name] = (dict(live.traffic), dict(wanted.traffic))
        if live.fallback_score != wanted.fallback_score:
            fallback[name] = (live.fallback_score, wanted.fallback_score)
        if live.tiers != wanted.tiers:
            tiers[name] = (live.tiers, wanted.tiers)
        if live.log_features != wanted.log_features:
            log_features[name] = (live.log_features, wanted.log_features)
        routing_changed |= _routing_of(running, name) != _routing_of(declared, name)
        served_by_both.append(name)
    for name, wanted in declared.models.items():
        if name not in running.models:
            added_models.append(name)
            models[name] = wanted
            versions["added"] += [(name, v) for v in wanted.versions]
            weights[name] = ({}, dict(wanted.traffic))

    views = {}
    added_views: list[str] = []
    removed_views: list[str] = []
    kept_views: list[str] = []
    for name, live_view in running.feature_views.items():
        wanted_view = declared.feature_views.get(name)
        if wanted_view is None:
            readers = sorted(m for m, spec in models.items() if name in views_read_by(spec))
            if not prune:
                kept_views.append(name)
                views[name] = live_view
                continue
            if readers:
                raise PlanRefused(
                    f"feature_views.{name}: still read by models.{readers[0]}; a view a model "
                    "reads cannot go (remove the model with it: --prune)"
                )
            removed_views.append(name)
            continue
        where = first_difference(
            live_view.model_dump(mode="json"),
            wanted_view.model_dump(mode="json"),
            f"feature_views.{name}",
        )
        if where:
            raise PlanRefused(
                f"{where}: changes a feature view already served; add a view under a new name "
                "and point a new model at it"
            )
        views[name] = live_view
    for name, wanted_view in declared.feature_views.items():
        if name not in running.feature_views:
            added_views.append(name)
            views[name] = wanted_view

    try:
        target = MeshSpec.model_validate(
            {
                **running.model_dump(),
                "models": {n: m.model_dump() for n, m in models.items()},
                "feature_views": {n: v.model_dump() for n, v in views.items()},
                "traffic": declared.traffic.model_dump(),
                "coalescing": declared.coalescing.model_dump(),
                "logs": declared.logs.model_dump(),
                "scaling": declared.scaling.model_dump(),
            }
        )
    except ValueError as exc:
        # pydantic's first line counts the errors; the next says which and why.
        lines = [line.strip() for line in str(exc).splitlines()[1:3]]
        raise PlanRefused(" ".join(lines) or str(exc)) from None
    return ApplyPlan(
        target=target,
        added_models=added_models,
        removed_models=removed_models,
        kept_models=kept_models,
        added_versions=versions["added"],
        removed_versions=versions["removed"],
        added_views=added_views,
        removed_views=removed_views,
        kept_views=kept_views,
        weights=weights,
        fallback=fallback,
        tiers=tiers,
        log_features=log_features,
        routing_changed=routing_changed,
        routing=routing_changes(running, declared, served_by_both),
        coalescing=(
            (running.coalescing, declared.coalescing)
            if running.coalescing != declared.coalescing
            else None
        ),
        logs=(running.logs, declared.logs) if running.logs != declared.logs else None,
        scaling=(running.scaling, declared.scaling)
        if running.scaling != declared.scaling
        else None,
    )
