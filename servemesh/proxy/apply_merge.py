"""What a short `servemesh apply` file means: the running spec, with the file's fields over it.

A file says only what it changes. Every field it leaves out keeps the running mesh's value,
at any depth: a section, a model's `inputs` or `traffic`, one field of a policy. So
`models: {risk: {versions: {v2: {}}}}` adds risk v2 to the running risk, whatever risk's
inputs and weights are, rather than to a model built from the defaults of what the file
omits (the demo's feature view, `traffic: {v1: 100, v2: 0}`).

- An object the file gives (a section, a model, a policy, `tiers`) is merged field by field.
- Anything else it gives replaces the running value whole: a list (`zones`, `features`), a
  map of values (`traffic` weights, `inputs`, `per_zone`), and `null` (`tiers: null` turns a
  model's tiers off).
- The named collections (`models`, `feature_views`, a model's `versions`) are merged by name:
  an entry the file leaves out keeps running, unless `prune`, where the entries the file
  gives are the whole collection (an entry it gives is still merged with its running one).
"""

from __future__ import annotations

from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from servemesh.proxy.live_plan import PlanRefused
from servemesh.spec import FeatureViewSpec, MeshSpec, ModelSpec, ModelVersionSpec

Data = dict[str, Any]

# Collections of named entries: merged by name, pruned with --prune.
NAMED: dict[tuple[type[BaseModel], str], type[BaseModel]] = {
    (MeshSpec, "models"): ModelSpec,
    (MeshSpec, "feature_views"): FeatureViewSpec,
    (ModelSpec, "versions"): ModelVersionSpec,
}
# A model's shorthand for its one input; `inputs` replaces it (the two cannot be mixed).
SHORTHAND = ("feature_view", "features")


def merge_over_running(running: Data, given: Data, *, prune: bool) -> Data:
    """The spec data a file's `given` top level means over the running declared spec
    (`running`, as `model_dump(mode="json")` writes it)."""
    return _merge_object(MeshSpec, running, given, prune=prune, path="")


def _object_type(annotation: Any) -> type[BaseModel] | None:
    """The model class a field holds (`X` or `X | None`); None for anything else."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        if len(kinds) == 1:
            return _object_type(kinds[0])
    return None


def _key_in(running: Data, kind: type[BaseModel], key: str) -> tuple[str, str | None]:
    """The key `key` has in the running data (a field given by name where the running data
    holds its alias, e.g. tiers' `source` for `from`), and the field's name."""
    for name, info in kind.model_fields.items():
        if key in (name, info.alias):
            if info.alias and info.alias in running:
                return info.alias, name
            return name, name
    return key, None  # not a field: validation names it


def _merge_object(
    kind: type[BaseModel], running: Data, given: Data, *, prune: bool, path: str
) -> Data:
    merged = dict(running)
    for raw_key, value in given.items():
        key, name = _key_in(running, kind, raw_key)
        live = running.get(key)
        where = f"{path}.{key}" if path else key
        entry_kind = NAMED.get((kind, name or ""))
        sub_kind = _object_type(kind.model_fields[name].annotation) if name else None
        if entry_kind and isinstance(value, dict) and isinstance(live, dict):
            merged[key] = _merge_named(entry_kind, live, value, prune=prune, path=where)
        elif sub_kind and isinstance(value, dict) and isinstance(live, dict):
            merged[key] = _merge_object(sub_kind, live, value, prune=prune, path=where)
        else:
            merged[key] = value
    if kind is ModelSpec:
        _model_rules(running, given, merged, prune=prune, path=path)
    return merged


def _merge_named(
    kind: type[BaseModel], running: Data, given: Data, *, prune: bool, path: str
) -> Data:
    entries = {} if prune else dict(running)
    for name, value in given.items():
        live = running.get(name)
        if isinstance(live, dict) and isinstance(value, dict):
            value = _merge_object(kind, live, value, prune=prune, path=f"{path}.{name}")
        entries[name] = value
    return entries


def _model_rules(running: Data, given: Data, merged: Data, *, prune: bool, path: str) -> None:
    """What a model's fields mean together: `inputs` and the shorthand replace each other,
    and versions --prune drops keep the weights and the shadow from naming them."""
    if given.get("inputs") is not None and not set(SHORTHAND) & set(given):
        for field in SHORTHAND:
            merged.pop(field, None)
    if set(SHORTHAND) & set(given) and "inputs" not in given:
        merged.pop("inputs", None)
    versions = merged.get("versions")
    if not isinstance(versions, dict):
        return
    dropped = [v for v in running.get("versions") or {} if v not in versions]
    if prune and dropped:
        _keep_dropped_versions_unnamed(running, given, merged, dropped, path)


def _keep_dropped_versions_unnamed(
    running: Data, given: Data, merged: Data, dropped: list[str], path: str
) -> None:
    """Versions a model's `versions` leaves out under --prune: a weight of 0 in the running
    traffic goes with them; a weight or a shadow that the file does not move is refused,
    naming the version and what to give."""
    model = path.rsplit(".", 1)[-1]
    weights = running.get("traffic") or {}
    if "traffic" not in given:
        served = [v for v in running.get("versions") or {} if v in merged["versions"]]
        for version in dropped:
            weight = weights.get(version, 0)
            if not weight:
                continue
            staying = next(iter(merged["versions"]), "<another version>")
            refusal = (
                f"{path}.versions.{version}: still takes {weight}% of traffic, and the file "
                f"gives no {path}.traffic to move it; give {path}.traffic without {version} "
                f"(e.g. {{{staying}: 100}})"
            )
            if served:  # a version that stays serving can take the weight now
                refusal += (
                    f", or move its weight first: servemesh routes set {model} {served[0]}=100"
                )
            raise PlanRefused(refusal)
        merged["traffic"] = {v: w for v, w in weights.items() if v not in dropped}
    shadow = running.get("shadow")
    if "shadow" not in given and isinstance(shadow, dict) and shadow.get("version") in dropped:
        raise PlanRefused(
            f"{path}.versions.{shadow['version']}: is the shadow target of {model}; turn the "
            f"shadow off first (servemesh routes shadow {model} --off), or give {path}.shadow "
            "in the file"
        )
