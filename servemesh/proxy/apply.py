"""Change what a running Envoy serves, safely: render, validate, swap atomically, confirm.

A change is refused before anything moves when the spec is invalid, when it changes more
than routing and policy (processes, ports, model versions need a restart), or when Envoy's
own validator rejects the rendered config. Accepted changes are written as watched files
(only those whose content changed), renamed into place, and confirmed from Envoy's admin
API; every change is appended to the history with who, when and what.

The history is append-only JSON lines, one snapshot of an entry per line; the last line of
an id wins. An entry is written `pending` before any watched file moves, and completed as
`applied` or `failed` after: a change that crashes half-way stays visible as pending. When
Envoy does not confirm a change in time, the previous files are put back, the resolved spec
is left as it was, and the entry says so. A torn line (a crash mid-write) is skipped with a
warning naming it.
"""

from __future__ import annotations

import functools
import getpass
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import yaml

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.errors import NoMesh
from servemesh.contract.yaml_text import dump_yaml, load_yaml
from servemesh.proxy.admin import AdminClient, AdminError, admin_socket_path
from servemesh.proxy.process import validate_config, validate_mounted
from servemesh.proxy.render import (
    EnvoyResources,
    render_proxies,
    static_bootstrap,
    xds_files,
)
from servemesh.spec import (
    EDGE_PROXY,
    MeshSpec,
    ResolvedSpec,
    SpecError,
    declared,
    dump_spec,
    parse_resolved,
    parse_spec_or_resolved,
)
from servemesh.state.paths import ApplyError, MeshPaths, NoRunningMesh, XdsLayout

# Fields a live apply may change. Everything else describes processes and needs a restart.
ROUTING_FIELDS_TOP = {"traffic"}
ROUTING_FIELDS_MODEL = {"traffic", "shadow", "policy"}
# Parts of the top-level `traffic` a rollback never puts back: who may call the edge and
# how fast are access decisions, not routing; an old entry must not resurrect them.
NEVER_ROLLED_BACK = {"edge_auth", "rate_limit"}

# History entry states.
PENDING, APPLIED, FAILED = "pending", "applied", "failed"

log = logging.getLogger(__name__)


P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class ApplyResult:
    version: str
    changed_files: list[str]
    confirm_ms: float
    diff: list[str]
    entry_id: int | None


def _without_version(content: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in content.items() if k != "version_info"}


def routing_view(spec: MeshSpec) -> dict[str, Any]:
    """The part of a spec a live apply may change, as plain data."""
    return {
        "traffic": spec.traffic.model_dump(mode="json"),
        "models": {
            name: {
                "traffic": dict(model.traffic),
                "shadow": model.shadow.model_dump(mode="json") if model.shadow else None,
                "policy": model.policy.model_dump(mode="json") if model.policy else None,
            }
            for name, model in spec.models.items()
        },
    }


def _topology(spec: MeshSpec) -> dict[str, Any]:
    data = spec.model_dump(mode="json")
    for key in ROUTING_FIELDS_TOP:
        data.pop(key, None)
    for model in data["models"].values():
        for key in ROUTING_FIELDS_MODEL:
            model.pop(key, None)
    # The launcher resolves these (and `up --netns` sets the network); a spec file being
    # applied usually leaves them out, and the live mesh keeps its own.
    for key in (
        "ports",
        "state_dir",
        "feature_store",
        "demo",
        "network",
    ):
        data.pop(key, None)
    return data


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    """Plain data as `a.b.c: value` pairs (an empty mapping is a value of its own)."""
    if isinstance(value, dict) and value:
        found: dict[str, Any] = {}
        for key, inner in value.items():
            found.update(_leaves(inner, f"{path}.{key}" if path else str(key)))
        return found
    return {path: value}


def diff_lines(before: MeshSpec, after: MeshSpec) -> list[str]:
    """What a change does to the routing, a line per value, in the live plan's words:
    `~ models.fraud.traffic.v1: 100 -> 90`, `+ ...` added, `- ...` removed."""
    old, new = _leaves(routing_view(before)), _leaves(routing_view(after))
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            lines.append(f"- {key}: {json.dumps(old[key])}")
        elif key not in old:
            lines.append(f"+ {key}: {json.dumps(new[key])}")
        elif old[key] != new[key]:
            lines.append(f"~ {key}: {json.dumps(old[key])} -> {json.dumps(new[key])}")
    return lines


def one_change_at_a_time(
    method: Callable[Concatenate[RouteManager, P], R],
) -> Callable[Concatenate[RouteManager, P], R]:
    """Run a RouteManager change under its mesh's change lock, from reading the live spec
    to recording the result, so no other change slips in between."""

    @functools.wraps(method)
    def locked(self: RouteManager, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.paths.change_lock():
            return method(self, *args, **kwargs)

    return locked


class RouteManager:
    """Reads and changes the routing of the mesh running from `paths`."""

    def __init__(
        self,
        paths: MeshPaths,
        admin: AdminClient | None = None,
        *,
        confirm_timeout_s: float = 10.0,
    ) -> None:
        # Absolute: rendered file references (EDS paths inside CDS) must not depend on the
        # caller's working directory (Envoy runs in the state dir and would not find them).
        self.paths = MeshPaths(Path(paths.state_dir).resolve())
        self._admin = admin
        self._admins: dict[str, AdminClient] = {}
        self._proxies: list[str] | None = None
        # How long Envoy has to report a swapped version before the change is undone.
        self.confirm_timeout_s = confirm_timeout_s

    # --- state ---------------------------------------------------------------------

    def live_spec(self) -> ResolvedSpec:
        try:
            return self.paths.running_spec()
        except NoRunningMesh as exc:
            raise ApplyError(str(exc), exit_code=exc.exit_code) from None

    @property
    def admin(self) -> AdminClient:
        """The edge Envoy's admin API (the shared layout's only Envoy's)."""
        if self._admin is None:
            socket = admin_socket_path(self.paths.state_dir)
            if not self.paths.endpoints.is_file() and socket.exists():
                # A mesh in containers: no `up` wrote its endpoints, and the edge's admin
                # socket is mounted where the state dir keeps it.
                self._admin = AdminClient(str(socket))
                return self._admin
            if not self.paths.endpoints.is_file():
                raise ApplyError(str(NoMesh(self.paths.state_dir)), exit_code=NoMesh.exit_code)
            endpoints = json.loads(self.paths.endpoints.read_text())
            self._admin = AdminClient(str(endpoints["envoy_admin"]))
        return self._admin

    def admin_of(self, proxy: str) -> AdminClient:
        """The admin API of one of the mesh's Envoys (by name: spec.proxies())."""
        if proxy == EDGE_PROXY:
            return self.admin
        found = self._admins.get(proxy)
        if found is None:
            found = AdminClient(admin_socket_path(self.paths.state_dir, proxy))
            self._admins[proxy] = found
        return found

    def admins(self, spec: MeshSpec | None = None) -> dict[str, AdminClient]:
        """Every Envoy of the mesh by name, the edge's first. The set is read from the
        running spec once: the layout and the zones are topology, which no live change
        moves (pollers such as envoy_hosts would otherwise load the spec each round)."""
        if spec is not None:
            return {proxy: self.admin_of(proxy) for proxy in spec.proxies()}
        if self._proxies is None:
            self._proxies = self.live_spec().proxies()
        return {proxy: self.admin_of(proxy) for proxy in self._proxies}

    def history(self) -> list[dict[str, Any]]:
        """Every entry, oldest first, each as its last line says (pending, applied or
        failed). A line that is not a whole entry is skipped with a warning naming it."""
        path = self.paths.history
        if not path.is_file():
            return []
        entries: dict[int, dict[str, Any]] = {}
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                entry = None
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), int):
                log.warning(
                    "%s line %d is not a history entry (torn write?); skipped", path.name, number
                )
                continue
            entry.setdefault("status", APPLIED)  # entries from before statuses existed
            entries[entry["id"]] = entry
        return list(entries.values())

    # --- changes -------------------------------------------------------------------

    @one_change_at_a_time
    def set_weights(
        self,
        model: str,
        weights: dict[str, int],
        *,
        who: str | None = None,
        reason: str | None = None,
    ) -> ApplyResult:
        """`model`'s weights (every version not named gets 0); `reason`, when given, is
        recorded in the history entry's action after the weights (a quarantine's)."""
        live = self.live_spec()
        if model not in live.models:
            raise ApplyError(f"model {model!r} is not served; served models: {sorted(live.models)}")
        current = live.models[model]
        unknown = sorted(set(weights) - set(current.versions))
        if unknown:
            raise ApplyError(
                f"model {model!r} has no version {unknown}; versions: {sorted(current.versions)}"
            )
        negative = {v: w for v, w in weights.items() if w < 0}
        if negative:
            raise ApplyError(f"weights must not be negative: {negative}")
        full = {version: weights.get(version, 0) for version in current.versions}
        if sum(full.values()) != 100:
            raise ApplyError(f"weights must sum to 100, got {sum(full.values())} ({full})")
        action = f"set {model} " + _weights_text(full)
        if reason:
            action += f" ({reason})"
        return self._apply_models(live, {model: {"traffic": full}}, action, who)

    @one_change_at_a_time
    def set_shadow(
        self, model: str, version: str | None, percent: float = 100.0, *, who: str | None = None
    ) -> ApplyResult:
        live = self.live_spec()
        if model not in live.models:
            raise ApplyError(f"model {model!r} is not served; served models: {sorted(live.models)}")
        shadow = None if version is None else {"version": version, "percent": percent}
        action = (
            f"shadow {model} off"
            if version is None
            else f"shadow {model} -> {version} ({percent:g}%)"
        )
        return self._apply_models(live, {model: {"shadow": shadow}}, action, who)

    @one_change_at_a_time
    def apply_spec_text(self, text: str, source: str, *, who: str | None = None) -> ApplyResult:
        """Apply a spec file's routing and policy. The file may be a declared spec or a
        running mesh's resolved one (edited in place); only its declared part counts."""
        try:
            proposed = declared(parse_spec_or_resolved(text, source))
        except SpecError as exc:
            raise ApplyError(str(exc)) from None
        live = self.live_spec()
        if _topology(proposed) != _topology(declared(live)):
            raise ApplyError(
                f"{source} changes more than routing and policy (traffic, models.*.traffic, "
                "models.*.shadow, models.*.policy); restart the mesh to change processes "
                "or versions"
            )
        update = {"traffic": proposed.traffic}
        models = {
            name: live.models[name].model_copy(
                update={
                    field: getattr(proposed.models[name], field) for field in ROUTING_FIELDS_MODEL
                }
            )
            for name in live.models
        }
        return self._apply(
            live, live.model_copy(update={**update, "models": models}), f"apply {source}", who
        )

    @one_change_at_a_time
    def rollback(self, entry_id: int | None = None, *, who: str | None = None) -> ApplyResult:
        """No id: undo the last change. With an id: return to the state right after it."""
        live, target, action = self.rollback_plan(entry_id)
        return self._apply(live, target, action, who)

    def rollback_plan(self, entry_id: int | None = None) -> tuple[ResolvedSpec, ResolvedSpec, str]:
        """What `rollback(entry_id)` would serve: the live spec, the spec after it, and the
        history's action; nothing changed (the gates judge it first: change_gates)."""
        applied = [e for e in self.history() if e["status"] == APPLIED]
        if not applied:
            raise ApplyError("nothing to roll back: no change has been applied")
        if entry_id is None:
            last = applied[-1]
            undone, target, action = [last], last["before"], f"rollback of #{last['id']}"
        else:
            matches = [e for e in applied if e["id"] == entry_id]
            if not matches:
                ids = ", ".join(f"#{e['id']}" for e in applied[-10:])
                raise ApplyError(f"no applied history entry #{entry_id}; latest applied: {ids}")
            undone = [e for e in applied if e["id"] > entry_id]
            target, action = matches[0]["after"], f"rollback to #{entry_id}"
        live = self.live_spec()
        touched = set().union(*(_touched(e) for e in undone)) if undone else set()
        return live, _restore(live, target, touched), action

    # --- internals ------------------------------------------------------------------

    def _apply_models(
        self, live: ResolvedSpec, changes: dict[str, dict[str, Any]], action: str, who: str | None
    ) -> ApplyResult:
        models = dict(live.models)
        for name, fields in changes.items():
            try:
                models[name] = models[name].model_validate(
                    {**models[name].model_dump(mode="json"), **fields}
                )
            except ValueError as exc:
                raise ApplyError(f"models.{name}: {exc}") from None
        return self._apply(live, live.model_copy(update={"models": models}), action, who)

    @one_change_at_a_time
    def swap(
        self,
        live: ResolvedSpec,
        proposed: ResolvedSpec,
        action: str,
        who: str | None = None,
        *,
        routes_first: bool = False,
        changes: list[str] | None = None,
        record: bool = True,
    ) -> ApplyResult:
        """Make Envoy serve `proposed`: render, validate, swap the changed files, confirm,
        then write the resolved spec (the services follow it) and record the change.

        Clusters are written before the routes that name them; with `routes_first` the
        routes go first, for a change that only removes clusters (no route may name a
        cluster that is gone). `changes`, when given, are lines that describe the whole
        change (an apply's plan, a fleet or scaling step), recorded instead of the routing
        view's JSON diff, whose fragments would only repeat them unreadably; a step of a
        larger change is not recorded on its own (`record=False`).
        """
        return self._apply(
            live,
            proposed,
            action,
            who,
            routes_first=routes_first,
            changes=changes,
            record=record,
        )

    def _apply(
        self,
        live: ResolvedSpec,
        proposed: ResolvedSpec,
        action: str,
        who: str | None,
        *,
        routes_first: bool = False,
        changes: list[str] | None = None,
        record: bool = True,
    ) -> ApplyResult:
        # Round-trip through the validator: model_copy does not re-run validation.
        try:
            proposed = parse_resolved(dump_spec(proposed), "proposed change")
        except SpecError as exc:
            raise ApplyError(str(exc)) from None
        diff = list(changes) if changes else diff_lines(live, proposed)
        # Rendered as the Envoys see the state dir, written where it lies here (the same
        # folder on one machine; a mesh in containers mounts it elsewhere).
        seen = self.paths.as_envoys_see_it()
        rendered = proposed
        if seen != self.paths:
            rendered = proposed.model_copy(update={"state_dir": str(seen.state_dir)})
        by_proxy = render_proxies(rendered, seen.logs)
        self._validate(rendered, by_proxy)
        version = str(int(time.time() * 1000))
        changed: dict[Path, dict[str, Any]] = {}
        # What each Envoy must report at the new version once its files are swapped.
        routes: dict[str, set[str]] = {}
        clusters: dict[str, set[str]] = {}
        stale: list[Path] = []
        for proxy, resources in by_proxy.items():
            layout = self.paths.xds_of(proxy)
            files = {
                self.paths.here(path): content
                for path, content in xds_files(resources, seen.xds_of(proxy), version).items()
            }
            mine = {p: c for p, c in files.items() if _without_version(c) != _on_disk(p)}
            changed.update(mine)
            routes[proxy] = {
                c["resources"][0]["name"] for p, c in mine.items() if p.parent.name == "rds"
            }
            clusters[proxy] = set()
            if layout.cds in mine:
                before = _on_disk_resources(layout.cds)
                clusters[proxy] = {
                    r["name"] for r in mine[layout.cds]["resources"] if before.get(r["name"]) != r
                }
            # Endpoint files of clusters the change removes (deleted once Envoy confirmed).
            stale += [
                path for path in layout.eds_files() if path not in files and path.suffix == ".yaml"
            ]
        route_files = [p for p in changed if p.parent.name == "rds"]
        cluster_files = sorted(
            (p for p in changed if p.parent.name != "rds"), key=lambda p: p.parent.name != "eds"
        )
        # A route naming a cluster Envoy does not serve (yet, or any more) answers no
        # cluster: new clusters must be active (warmed: endpoints read, first health checks
        # passed) before a route names them, and routes must stop naming clusters before
        # those go. So the two halves are swapped and confirmed one after the other, on
        # every Envoy of the mesh before the next half.
        none: dict[str, set[str]] = {}
        steps = [(cluster_files, none, clusters), (route_files, routes, none)]
        if routes_first:
            steps.reverse()
        entry = None
        if diff and record:  # before anything moves: a crash from here on stays visible
            entry = self._begin_entry(action, who, live, proposed, diff, version)
        previous = {path: _read_text(path) for path in changed}
        started = time.perf_counter()
        try:
            for paths, step_routes, step_clusters in steps:
                for path in paths:  # endpoints before the clusters that read them
                    atomic_write_text(path, dump_yaml(changed[path]))
                for proxy in by_proxy:
                    self._confirm(
                        proxy,
                        step_routes.get(proxy, set()),
                        step_clusters.get(proxy, set()),
                        version,
                    )
        except (ApplyError, OSError) as exc:
            # Envoy never took it (or a file could not be written): put the old files back
            # so what Envoy serves, the files and the resolved spec (not written) agree.
            restored = _put_back(previous)
            why = f"{exc}; {restored}"
            if entry is not None:
                self._finish_entry(entry, FAILED, time.perf_counter() - started, error=why)
            raise ApplyError(f"{why}; the live spec is unchanged") from None
        except BaseException:
            _put_back(previous)
            if entry is not None:
                self._finish_entry(
                    entry, FAILED, time.perf_counter() - started, error="interrupted"
                )
            raise
        # The services follow the file: written once Envoy serves the change, so nothing
        # relies on a route too early.
        atomic_write_text(self.paths.resolved_spec, dump_spec(proposed))
        confirm_ms = (time.perf_counter() - started) * 1000
        for path in stale:
            path.unlink(missing_ok=True)
        entry_id = None
        if entry is not None:
            self._finish_entry(entry, APPLIED, confirm_ms / 1000)
            entry_id = int(entry["id"])
        return ApplyResult(
            version=version,
            changed_files=[str(p.relative_to(self.paths.state_dir)) for p in changed],
            confirm_ms=confirm_ms,
            diff=diff,
            entry_id=entry_id,
        )

    def _validate(self, spec: ResolvedSpec, by_proxy: dict[str, EnvoyResources]) -> None:
        """Each Envoy's part checked by Envoy itself (`--mode validate`), before any file
        moves: a part one Envoy would refuse is refused for all of them."""
        seen = self.paths.as_envoys_see_it()
        with tempfile.TemporaryDirectory() as tmp:
            for proxy, resources in by_proxy.items():
                config = Path(tmp) / f"{proxy}.yaml"
                bootstrap = static_bootstrap(spec, resources, seen.logs, proxy)
                try:
                    if seen == self.paths:
                        config.write_text(dump_yaml(bootstrap))
                        validate_config(config)
                    else:  # in containers: checked against the same files here
                        sockets = [admin_socket_path(seen.state_dir, p) for p in by_proxy]
                        validate_mounted(
                            dump_yaml(bootstrap), seen.state_dir, self.paths.state_dir, sockets
                        )
                except ValueError as exc:
                    raise ApplyError(
                        f"{_envoy_named(proxy)} refuses the rendered config:\n{exc}"
                    ) from None

    def _confirm(self, proxy: str, routes: set[str], clusters: set[str], version: str) -> None:
        """Wait until the Envoy's admin API reports the new version of what changed."""
        if not routes and not clusters:
            return  # this step moved nothing this Envoy reports a version of
        timeout_s = self.confirm_timeout_s
        deadline = time.monotonic() + timeout_s
        envoy = _envoy_named(proxy)
        while True:
            try:
                served = self.admin_of(proxy).served_versions()
            except AdminError as exc:  # Envoy gone or not answering: not confirmed
                if time.monotonic() > deadline:
                    raise ApplyError(
                        f"{envoy}'s admin API did not answer within {timeout_s:g} s ({exc})"
                    ) from None
                time.sleep(0.05)
                continue
            pending = [r for r in routes if served.routes.get(r) != version]
            pending += [c for c in clusters if served.clusters.get(c) != version]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise ApplyError(
                    f"{envoy} did not pick up version {version} within {timeout_s:g} s "
                    f"for {sorted(pending)}"
                )
            time.sleep(0.01)

    def _begin_entry(
        self,
        action: str,
        who: str | None,
        before: MeshSpec,
        after: MeshSpec,
        diff: list[str],
        version: str,
    ) -> dict[str, Any]:
        """Append the change as pending (under the change lock: ids cannot collide)."""
        history = self.history()
        entry_id = max((int(e["id"]) for e in history), default=0) + 1
        entry: dict[str, Any] = {
            "id": entry_id,
            "status": PENDING,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "who": who or operator_name(),
            "action": action,
            "version": version,
            "apply_ms": None,
            "diff": diff,
            "before": routing_view(before),
            "after": routing_view(after),
        }
        self._append(entry)
        return entry

    def _finish_entry(
        self, entry: dict[str, Any], status: str, seconds: float, error: str | None = None
    ) -> None:
        entry.update(status=status, apply_ms=round(seconds * 1000, 1))
        if error is not None:
            entry["error"] = error
        self._append(entry)

    def _append(self, entry: dict[str, Any]) -> None:
        path = self.paths.history
        line = json.dumps(entry) + "\n"
        with path.open("a+b") as handle:
            # A torn last line (a crash mid-write) must not swallow this one.
            handle.seek(0, os.SEEK_END)
            if handle.tell() > 0:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":
                    line = "\n" + line
            handle.write(line.encode())
            handle.flush()
            os.fsync(handle.fileno())


def _touched(entry: dict[str, Any]) -> set[tuple[str, ...]]:
    """The routing fields an entry changed: ("traffic", key) at the top, ("models", name,
    field) per model; never an edge user or rate limit."""
    before, after = entry.get("before") or {}, entry.get("after") or {}
    fields: set[tuple[str, ...]] = set()
    old_top, new_top = before.get("traffic") or {}, after.get("traffic") or {}
    for key in set(old_top) | set(new_top):
        if key not in NEVER_ROLLED_BACK and old_top.get(key) != new_top.get(key):
            fields.add(("traffic", key))
    old_models, new_models = before.get("models") or {}, after.get("models") or {}
    for name in set(old_models) | set(new_models):
        old, new = old_models.get(name) or {}, new_models.get(name) or {}
        for key in ROUTING_FIELDS_MODEL:
            if old.get(key) != new.get(key):
                fields.add(("models", name, key))
    return fields


def _restore(
    live: ResolvedSpec, target: dict[str, Any], touched: set[tuple[str, ...]]
) -> ResolvedSpec:
    """`live` with each touched field set as `target` (a routing view) has it; models the
    target does not know, or that are no longer served, are left as they are."""
    traffic = live.traffic.model_dump(mode="json")
    models = {name: model.model_dump(mode="json") for name, model in live.models.items()}
    saved_models = target.get("models") or {}
    for field in touched:
        if field[0] == "traffic" and field[1] in (target.get("traffic") or {}):
            traffic[field[1]] = target["traffic"][field[1]]
        elif field[0] == "models" and field[1] in models and field[1] in saved_models:
            models[field[1]][field[2]] = saved_models[field[1]].get(field[2])
    try:
        return live.model_copy(
            update={
                "traffic": live.traffic.model_validate(traffic),
                "models": {
                    name: live.models[name].model_validate(data) for name, data in models.items()
                },
            }
        )
    except ValueError as exc:
        raise ApplyError(f"the saved state no longer fits the mesh: {exc}") from None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _put_back(previous: dict[Path, str | None]) -> str:
    """Write each file as it was (remove the ones that were new); says what it did."""
    failed = []
    for path, text in previous.items():
        try:
            if text is None:
                path.unlink(missing_ok=True)
            else:
                atomic_write_text(path, text)
        except OSError:
            failed.append(path.name)
    if failed:
        return f"could not restore {', '.join(sorted(failed))}"
    return f"the previous xDS files were restored ({len(previous)})"


def _on_disk(path: Path) -> dict[str, Any] | None:
    try:
        content = load_yaml(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return _without_version(content) if isinstance(content, dict) else None


def _on_disk_resources(path: Path) -> dict[str, Any]:
    content = _on_disk(path) or {}
    return {r["name"]: r for r in content.get("resources", [])}


def _weights_text(weights: dict[str, int]) -> str:
    return " ".join(f"{v}={w}" for v, w in sorted(weights.items()))


def operator_name() -> str:
    """Who runs the command, as the routes history (and the gates' record) name them."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _envoy_named(proxy: str) -> str:
    """How a message names one of the mesh's Envoys."""
    return "Envoy" if proxy == EDGE_PROXY else f"{proxy}'s Envoy"


def write_initial(spec: ResolvedSpec, resources: EnvoyResources, layout: XdsLayout) -> None:
    """Write every watched file for a mesh about to start (version 1)."""
    for path, content in xds_files(resources, layout, "1").items():
        atomic_write_text(path, dump_yaml(content))
