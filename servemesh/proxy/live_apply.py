"""`servemesh apply FILE`: make a running mesh match a spec file, live.

The order is what keeps every request answered:

1. plan (`live_plan`): what changes, or a one-line refusal naming the field;
2. the registry: every new version exists (an alias is refused: a spec names versions), and
   takes the same inputs as the model's other versions;
3. every model replica loads every new version (RepositoryModelLoad with the model's spec
   entry), in parallel, and reports the version's own health SERVING, which it does only
   once the load ran a probe batch through the batcher. A failure anywhere unloads what
   was loaded and refuses, naming the replica and its reason;
4. only then does Envoy route to it: the config is rendered, validated, swapped and
   confirmed (`RouteManager.swap`). Versions and models that go leave the routes before
   their clusters do;
5. the resolved spec is written: gateways and feature services take the new models and
   views, replicas unload what the spec no longer lists; the change is recorded in the
   history.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from servemesh.contract.control_credential import (
    ControlCredentialMissing,
    Metadata,
    control_metadata_for,
)
from servemesh.contract.wire import (
    LOAD_CONFIG_PARAMETER,
    LOAD_VERSION_PARAMETER,
    message_size_options,
    version_health_name,
)
from servemesh.identity import dial_registry, dial_service
from servemesh.proxy.apply import ApplyResult, RouteManager
from servemesh.proxy.apply_merge import merge_over_running
from servemesh.proxy.live_plan import ApplyPlan, Key, PlanRefused, plan_apply
from servemesh.proxy.replicas import wait_model_servers_in
from servemesh.spec import (
    RESOLVED_FIELDS,
    MeshSpec,
    ResolvedSpec,
    SpecError,
    declared,
    parse_spec,
    parse_spec_or_resolved,
    resolve,
)
from servemesh.spec.model_contract import check_model_contract
from servemesh.state.paths import ApplyError
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class ReplicaLoad:
    """How loading the new versions went on one replica."""

    replica: str
    loaded: list[Key]
    load_ms: float
    # "models.m.versions.v: reason" when a load failed; None when all loaded.
    failure: str | None = None


@dataclass(frozen=True)
class LiveApplyResult:
    plan: ApplyPlan
    dry_run: bool
    loads: list[ReplicaLoad] = field(default_factory=list)
    envoy: ApplyResult | None = None
    # A new pool's model servers, started by this apply and ready before it returned.
    started: list[str] = field(default_factory=list)


def _signature(record: registry_pb2.ModelVersion) -> list[tuple[str, str, list[int]]]:
    return [(t.name, t.datatype, list(t.shape)) for t in record.inputs]


def _signature_text(signature: list[tuple[str, str, list[int]]]) -> str:
    return ", ".join(f"{name} {dtype} {shape}" for name, dtype, shape in signature) or "none"


def model_contract_problem(
    spec: MeshSpec, model: str, record: registry_pb2.ModelVersion
) -> str | None:
    """Why a registry version cannot serve `spec.models[model]` as the spec declares it
    (its `inputs` against the version's signature: every tensor mapped, view inputs as wide
    as their features and of a float type), or None when it can."""
    problems = check_model_contract(model, spec.models[model], record.inputs, record.outputs)
    if not problems:
        return None
    shown = "; ".join(problems[:3])
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"{shown}{more}"


class LiveApply:
    """Applies spec files to the mesh running from `manager.paths`."""

    def __init__(
        self,
        manager: RouteManager,
        *,
        load_timeout_s: float = 300.0,
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.manager = manager
        self.load_timeout_s = load_timeout_s
        self.ready_timeout_s = ready_timeout_s

    def credential(self) -> Metadata:
        """The mesh's control call metadata: loads and unloads are control calls."""
        try:
            return control_metadata_for(self.manager.paths.state_dir)
        except ControlCredentialMissing as exc:
            raise ApplyError(str(exc)) from None

    # --- planning ---------------------------------------------------------------------

    def plan(
        self, text: str, source: str, *, prune: bool = False
    ) -> tuple[ResolvedSpec, ApplyPlan]:
        """The running spec and the plan for the file's text; ApplyError when refused."""
        live = self.manager.live_spec()
        try:
            proposed = over_running(text, live, source, prune=prune)
            plan = plan_apply(live, proposed, prune=prune)
        except SpecError as exc:
            raise ApplyError(str(exc)) from None
        except PlanRefused as exc:
            raise ApplyError(f"{source}: {exc}") from None
        if not prune:  # what the file's sections leave out, kept (shown to the operator)
            sections = _sections(text)
            plan = replace(
                plan,
                kept_models=[
                    m for m in live.models if m not in sections.get("models", live.models)
                ],
                kept_views=[
                    v
                    for v in live.feature_views
                    if v not in sections.get("feature_views", live.feature_views)
                ],
            )
        return live, plan

    # --- the whole change -------------------------------------------------------------

    def apply(
        self,
        text: str,
        source: str,
        *,
        prune: bool = False,
        dry_run: bool = False,
        who: str | None = None,
    ) -> LiveApplyResult:
        if dry_run:
            return self._apply(text, source, prune=prune, dry_run=True, who=who)
        with self.manager.paths.change_lock():
            return self._apply(text, source, prune=prune, dry_run=False, who=who)

    def _apply(
        self, text: str, source: str, *, prune: bool, dry_run: bool, who: str | None
    ) -> LiveApplyResult:
        live, plan = self.plan(text, source, prune=prune)
        if plan.added_versions:
            asyncio.run(self.check_registry(live, plan))
        if dry_run or not plan.changed:
            return LiveApplyResult(plan=plan, dry_run=dry_run)
        union, target = self._targets(live, plan)
        started = new_pool_replicas(live, target)
        if started and live.network.mode == "netns":
            raise ApplyError(
                f"models: a new pool needs processes of its own ({', '.join(started)}), and "
                "network.mode netns joins a zone's ports only at start; restart the mesh"
            )
        loads = asyncio.run(self.load_everywhere(live, plan)) if plan.added_versions else []
        try:
            envoy = self._swap(live, union, target, plan, f"apply {source}", who)
        except BaseException:
            # Refused before any file moved (Envoy's validator): undo the loads. Once the
            # files moved (a confirmation that timed out), the spec lists the new versions
            # and the replicas keep them.
            if plan.added_versions and not _lists_all(self.manager.live_spec(), plan):
                asyncio.run(self.unload_everywhere(live, loads))
            raise
        if started:
            self._wait_started(live, target, started, source, who)
        return LiveApplyResult(plan=plan, dry_run=False, loads=loads, envoy=envoy, started=started)

    def _wait_started(
        self,
        live: ResolvedSpec,
        target: ResolvedSpec,
        started: list[str],
        source: str,
        who: str | None,
    ) -> None:
        """A new pool's servers start once the spec lists them (`servemesh up` follows it):
        wait until they serve and Envoy counts them healthy; when they do not, put the
        running spec back (their processes stop) and refuse."""
        missing = wait_model_servers_in(self.manager, target, started, self.load_timeout_s)
        if not missing:
            return
        logs = ", ".join(str(self.manager.paths.state_dir / "logs" / f"{n}.log") for n in missing)
        self.manager.swap(
            self.manager.live_spec(),
            live,
            f"undo apply {source}",
            who,
            routes_first=True,
            changes=[f"- model servers {', '.join(started)}: not ready"],
        )
        raise ApplyError(
            f"{', '.join(missing)}: not serving within {self.load_timeout_s:g} s (see {logs}); "
            "nothing changed: the mesh is back as it was"
        )

    @staticmethod
    def _targets(live: ResolvedSpec, plan: ApplyPlan) -> tuple[ResolvedSpec | None, ResolvedSpec]:
        """(the spec between, the spec the change ends at). A change that adds and removes
        takes two swaps: new clusters go in before the routes that name them, old ones out
        after the routes that named them, so the spec between keeps what goes (None when
        one swap does). The target is resolved from the spec between, so a new pool's
        servers keep the ports they were started with at the first swap."""
        if not (plan.adds and plan.removes):
            return None, resolved_target(live, plan.target)
        union = resolved_target(live, _keeping_removed(plan, live))
        return union, resolved_target(union, plan.target)

    def _swap(
        self,
        live: ResolvedSpec,
        union: ResolvedSpec | None,
        target: ResolvedSpec,
        plan: ApplyPlan,
        action: str,
        who: str | None,
    ) -> ApplyResult:
        changes = plan.lines()
        if union is not None:
            self.manager.swap(live, union, action, who, record=False)
        return self.manager.swap(
            live, target, action, who, routes_first=plan.removes, changes=changes
        )

    # --- the registry -----------------------------------------------------------------

    async def check_registry(self, live: ResolvedSpec, plan: ApplyPlan) -> None:
        """Every new version is in the registry, named as such, with the model's inputs."""
        options = message_size_options(live.limits.max_message_bytes)
        async with dial_registry(live).aio_channel(options=options) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            records: dict[Key, registry_pb2.ModelVersion] = {}
            for model, version in plan.added_versions:
                records[(model, version)] = await self._version(stub, model, version)
            for model, version in plan.added_versions:
                record = records[(model, version)]
                where = f"models.{model}.versions.{version}"
                reference = next(
                    (v for v in plan.target.models[model].versions if (model, v) not in records),
                    None,
                )
                if reference is None:  # a new model: its first version sets its inputs
                    reference = next(v for m, v in plan.added_versions if m == model)
                    known = records[(model, reference)]
                else:
                    known = await self._version(stub, model, reference)
                if _signature(record) != _signature(known):
                    raise ApplyError(
                        f"{where}: inputs ({_signature_text(_signature(record))}) differ from "
                        f"{reference}'s ({_signature_text(_signature(known))}); every version "
                        "of a model takes the same inputs"
                    )
                problem = model_contract_problem(plan.target, model, record)
                if problem:
                    raise ApplyError(f"{where}: {problem}")

    async def _version(
        self, stub: registry_pb2_grpc.RegistryStub, model: str, version: str
    ) -> registry_pb2.ModelVersion:
        where = f"models.{model}.versions.{version}"
        try:
            record: registry_pb2.ModelVersion = await stub.GetVersion(
                registry_pb2.GetVersionRequest(model=model, version=version), timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise ApplyError(
                    f"{where}: not in the registry ({exc.details()}); push it first: "
                    f"servemesh models push FILE --model {model} --version {version}"
                ) from None
            raise ApplyError(
                f"{where}: the registry answered {exc.code().name}: {exc.details()}"
            ) from None
        if record.version != version:
            raise ApplyError(
                f"{where}: {version!r} is an alias of {record.version!r} in the registry; a "
                f"spec names versions: {record.version}"
            )
        return record

    # --- the replicas -----------------------------------------------------------------

    def _replicas(self, live: ResolvedSpec, plan: ApplyPlan) -> list[str]:
        """The running model servers that load a new version: those of its pool (a new
        pool's servers load theirs as they start)."""
        pools = {plan.target.pool_of(model) for model, _ in plan.added_versions}
        return [i.name for i in live.instances() if i.service == "model" and i.pool in pools]

    async def load_everywhere(self, live: ResolvedSpec, plan: ApplyPlan) -> list[ReplicaLoad]:
        """Load every new version on every replica in parallel; refuse (after unloading
        what was loaded) when any replica could not."""
        loads = await asyncio.gather(
            *(self._load_on(live, replica, plan) for replica in self._replicas(live, plan))
        )
        failed = [load for load in loads if load.failure]
        if failed:
            await self.unload_everywhere(live, loads)
            first = failed[0]
            others = f" (and {len(failed) - 1} more replicas)" if len(failed) > 1 else ""
            raise ApplyError(
                f"{first.replica}: {first.failure}{others}; nothing changed: the versions "
                "loaded for this apply were unloaded"
            )
        return list(loads)

    async def _load_on(self, live: ResolvedSpec, replica: str, plan: ApplyPlan) -> ReplicaLoad:
        loaded: list[Key] = []
        started = time.perf_counter()
        credential = self.credential()
        options = message_size_options(live.limits.max_message_bytes)
        async with dial_service(live, replica).aio_channel(options=options) as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            pool = live.instance(replica).pool
            for model, version in plan.added_versions:
                if plan.target.pool_of(model) != pool:
                    continue  # another pool's servers hold it (a new pool's load at start)
                where = f"models.{model}.versions.{version}"
                config = plan.target.models[model].model_dump_json()
                request = oip.RepositoryModelLoadRequest(
                    model_name=model,
                    parameters={
                        LOAD_VERSION_PARAMETER: oip.ModelRepositoryParameter(string_param=version),
                        LOAD_CONFIG_PARAMETER: oip.ModelRepositoryParameter(string_param=config),
                    },
                )
                try:
                    await stub.RepositoryModelLoad(
                        request, timeout=self.load_timeout_s, metadata=credential
                    )
                    loaded.append((model, version))
                    await self._until_serving(health, model, version)
                except grpc.aio.AioRpcError as exc:
                    return ReplicaLoad(
                        replica,
                        loaded,
                        _ms(started),
                        f"{where}: {exc.code().name}: {exc.details()}",
                    )
                except TimeoutError as exc:
                    return ReplicaLoad(replica, loaded, _ms(started), f"{where}: {exc}")
        return ReplicaLoad(replica, loaded, _ms(started))

    async def _until_serving(
        self, health: health_pb2_grpc.HealthStub, model: str, version: str
    ) -> None:
        """The version's own health SERVING: loaded and warmed up (a probe batch ran)."""
        name = version_health_name(model, version)
        give_up = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                answer = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                if answer.status == SERVING:
                    return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # not reported yet
                    raise
            if time.monotonic() > give_up:
                raise TimeoutError(
                    f"loaded, but its health {name!r} did not turn SERVING within "
                    f"{self.ready_timeout_s:.0f} s"
                )
            await asyncio.sleep(0.05)

    async def unload_everywhere(self, live: ResolvedSpec, loads: list[ReplicaLoad]) -> None:
        """Undo the loads of a refused apply (best effort: a replica that is down has
        nothing to undo, and it loads by the unchanged spec when it returns)."""
        options = message_size_options(live.limits.max_message_bytes)
        credential = self.credential()

        async def undo(load: ReplicaLoad) -> None:
            if not load.loaded:
                return
            dial = dial_service(live, load.replica)
            async with dial.aio_channel(options=options) as channel:
                stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
                for model, version in load.loaded:
                    param = oip.ModelRepositoryParameter(string_param=version)
                    request = oip.RepositoryModelUnloadRequest(
                        model_name=model, parameters={LOAD_VERSION_PARAMETER: param}
                    )
                    try:
                        await stub.RepositoryModelUnload(request, timeout=30, metadata=credential)
                    except grpc.aio.AioRpcError:
                        continue

        await asyncio.gather(*(undo(load) for load in loads))


def over_running(
    text: str, running: MeshSpec, source: str = "<spec>", *, prune: bool = False
) -> MeshSpec:
    """The declared spec a file means for the running mesh.

    Every field the file leaves out is the running mesh's, at any depth (`apply_merge`), so
    a file that declares only `models:` and `feature_views:` applies to a mesh of any shape,
    and a model entry that names only a new version keeps the model's running inputs and
    weights, rather than the built-in defaults of what it omits (two zones, the demo model
    and its view). Without `prune`, the models, views and versions the file leaves out are
    kept too (a file may declare just what it adds). A running mesh's resolved spec is taken
    whole. Raises PlanRefused when a version --prune drops still has weight or is a shadow
    target the file does not move.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if not isinstance(data, dict | type(None)) or RESOLVED_FIELDS & set(data or {}):
        return parse_spec_or_resolved(text, source)
    if data is None and text.strip():
        return parse_spec(text, source)  # malformed: the parser says where
    base = declared(running).model_dump(mode="json")
    merged = merge_over_running(base, dict(data or {}), prune=prune)
    try:
        return MeshSpec.model_validate(merged)
    except ValidationError as exc:
        problems = [
            f"{source}: {'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
            for err in exc.errors()
        ]
        raise SpecError("invalid mesh spec\n  " + "\n  ".join(problems)) from None


def _sections(text: str) -> dict[str, dict[str, object]]:
    """The file's `models` and `feature_views` sections that it declares (by name)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        k: v for k, v in data.items() if k in ("models", "feature_views") and isinstance(v, dict)
    }


def _lists_all(spec: MeshSpec, plan: ApplyPlan) -> bool:
    return all(
        model in spec.models and version in spec.models[model].versions
        for model, version in plan.added_versions
    )


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def resolved_target(live: ResolvedSpec, target: MeshSpec) -> ResolvedSpec:
    """The running mesh with the target's models, views, traffic, coalescing, logs, pools and
    scaling policy; the rest is the running mesh's own. A new model on a pool of its own
    brings that pool's processes: they get ports of their own, every other process keeps
    its."""
    return resolve(
        live.model_copy(
            update={
                "models": dict(target.models),
                "feature_views": dict(target.feature_views),
                "traffic": target.traffic,
                "coalescing": target.coalescing,
                "logs": target.logs,
                "scaling": target.scaling,
                "pools": dict(target.pools),
            }
        )
    )


def new_pool_replicas(live: ResolvedSpec, target: ResolvedSpec) -> list[str]:
    """The model servers `target` runs that `live` does not: a new pool's."""
    running = {i.name for i in live.instances()}
    return [i.name for i in target.instances() if i.service == "model" and i.name not in running]


def _keeping_removed(plan: ApplyPlan, live: MeshSpec) -> MeshSpec:
    """The target, but still serving what the plan removes (their weight is already 0)."""
    models = dict(plan.target.models)
    for name in plan.removed_models:
        models[name] = live.models[name]
    for name, version in plan.removed_versions:
        if name in plan.removed_models:
            continue
        model = models[name]
        versions = {**model.versions, version: live.models[name].versions[version]}
        models[name] = model.model_copy(update={"versions": versions})
    views = dict(plan.target.feature_views)
    for name in plan.removed_views:
        views[name] = live.feature_views[name]
    return plan.target.model_copy(update={"models": models, "feature_views": views})
