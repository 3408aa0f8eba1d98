"""The mesh spec: one typed, validated description of zones, services, models and policy.

Everything reads it: `servemesh up` starts processes from it, the Envoy renderer writes
config from it, each service finds its port and peers in it. An empty file is a complete
spec: the defaults below are the demo mesh that `servemesh up` runs.

MeshSpec is what a spec file declares; its sections are typed in the modules beside this
one (servemesh/spec/__init__.py lists them), a running mesh's spec in resolve.py.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypeVar, get_args

from pydantic import Field, field_validator, model_validator

from servemesh.contract.demo import DEMO_FEATURES
from servemesh.spec.base import (
    SCALED_KINDS,
    FrontKind,
    Name,
    ScaledKind,
    ServiceKind,
    SpecError,
    ZoneName,
    _Strict,
)
from servemesh.spec.features import FeatureStoreSpec, FeatureViewSpec
from servemesh.spec.fleet import (
    REGISTRY_INSTANCE,
    Instance,
    Replicas,
    instance_name,
    model_set_instances,
    registry_mirror_name,
    replicas_field,
)
from servemesh.spec.models import (
    SHARED_POOL,
    CoalescingSpec,
    ModelSpec,
    PoolName,
    PoolSpec,
    own_pool_name,
)
from servemesh.spec.network import (
    EDGE_PROXY,
    ZONE_EDGE_PREFIX,
    DiscoverySpec,
    NetworkSpec,
    Ports,
    ProxySpec,
    TlsSpec,
    host_name_problem,
    proxy_part,
    zone_edge_proxy,
)
from servemesh.spec.observability import (
    TRACE_STORE_PART,
    CostSpec,
    LogsSpec,
    MetricsSpec,
    PredictionLogSpec,
    TracingSpec,
)
from servemesh.spec.policy import TrafficSpec
from servemesh.spec.rollout_plan import RolloutSpec
from servemesh.spec.scaling_policy import ScalingSpec
from servemesh.spec.services import (
    Deadlines,
    DemoSpec,
    Limits,
    ProcessesSpec,
    RegistrySpec,
    SandboxSpec,
)
from servemesh.spec.workloads import BatchJobSpec, StreamSpec

Spec = TypeVar("Spec", bound="MeshSpec")
Profile = Literal["default", "small-host"]


DEFAULT_ZONES = ("zone-a", "zone-b")


def profile_preset(profile: Profile, zones: Sequence[str]) -> dict[str, dict[str, object]]:
    """What a profile sets for each section the spec leaves out (a section the spec gives
    keeps the fields it names).

    default:    one gateway, one feature and one model process in every zone, and an Envoy
                per zone besides the edge's: no process spans two zones.
    small-host: a gateway in every zone, but one feature and one model process, in the
                first zone, serving every zone, and one Envoy holding the edge and every
                zone's listener and clusters. The zones stay in Envoy's config (each
                zone's gateway, mesh listener, localities and failover), so routes, weights
                and tools read the same in both."""
    if profile not in get_args(Profile):
        raise ValueError(f"profile: {profile!r} is not one of {list(get_args(Profile))}")
    every_zone = {zone: 1 for zone in zones}
    small_host = profile == "small-host"
    shared_processes = {zones[0]: 1} if small_host else every_zone
    return {
        "gateway": {"per_zone": every_zone},
        "feature": {"per_zone": shared_processes},
        "model_servers": {"per_zone": shared_processes},
        "proxy": {"layout": "shared" if small_host else "per_zone"},
    }


def _demo_views() -> dict[str, FeatureViewSpec]:
    return {"user": FeatureViewSpec(features=list(DEMO_FEATURES))}


# Where the prices lived before `cost:` existed; a spec that still sets them there means
# the same (moved by MeshSpec).
_OLD_PRICE_KEYS = {"price_per_core_hour": "per_core_hour", "price_per_gpu_hour": "per_gpu_hour"}


class MeshSpec(_Strict):
    name: Name = "servemesh"
    host: str = "127.0.0.1"
    # default:    every zone runs its own gateway, feature and model processes and its own
    #             Envoy: no process spans two zones, so a zone's failure stays its own.
    # small-host: one machine of a few cores serving every zone (profile_preset): less
    #             memory and idle CPU (docs/benchmarks.md); a drill that takes one zone's
    #             own feature or model processes away needs the default profile.
    profile: Profile = "default"
    zones: list[ZoneName] = Field(default_factory=lambda: list(DEFAULT_ZONES), min_length=1)
    ports: Ports = Field(default_factory=Ports)
    state_dir: str = ".servemesh"
    gateway: Replicas = Field(default_factory=Replicas)
    feature: Replicas = Field(default_factory=Replicas)
    model_servers: Replicas = Field(default_factory=Replicas)
    # Settings of the pools models are placed on (`models.<m>.pool`); a pool a model names
    # and this leaves out has the defaults.
    pools: dict[PoolName, PoolSpec] = Field(default_factory=dict)
    models: dict[Name, ModelSpec] = Field(default_factory=lambda: {"fraud": ModelSpec()})
    # The feature views of the online store; every model's feature_view names one.
    feature_views: dict[Name, FeatureViewSpec] = Field(default_factory=_demo_views)
    feature_store: FeatureStoreSpec = Field(default_factory=FeatureStoreSpec)
    traffic: TrafficSpec = Field(default_factory=TrafficSpec)
    limits: Limits = Field(default_factory=Limits)
    deadlines: Deadlines = Field(default_factory=Deadlines)
    demo: DemoSpec = Field(default_factory=DemoSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    proxy: ProxySpec = Field(default_factory=ProxySpec)
    tls: TlsSpec = Field(default_factory=TlsSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    prediction_log: PredictionLogSpec = Field(default_factory=PredictionLogSpec)
    logs: LogsSpec = Field(default_factory=LogsSpec)
    # How the gateways share feature reads and model calls between concurrent Predicts.
    coalescing: CoalescingSpec = Field(default_factory=CoalescingSpec)
    tracing: TracingSpec = Field(default_factory=TracingSpec)
    discovery: DiscoverySpec = Field(default_factory=DiscoverySpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    processes: ProcessesSpec = Field(default_factory=ProcessesSpec)
    # Streaming predictions: one consumer process per entry, started by `servemesh up`.
    streams: list[StreamSpec] = Field(default_factory=list, max_length=64)
    # Scheduled batch runs (docs/batch.md): `servemesh batch run-due`, or `servemesh up`.
    batch: list[BatchJobSpec] = Field(default_factory=list, max_length=64)
    # The scaler `servemesh up` runs: model servers per zone follow the traffic between the
    # policy's bounds (docs/capacity.md).
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    cost: CostSpec = Field(default_factory=CostSpec)
    # The model registry's own settings (its size limits are in `limits`).
    registry: RegistrySpec = Field(default_factory=RegistrySpec)

    @model_validator(mode="before")
    @classmethod
    def _profile_fills_what_the_spec_leaves_out(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        profile = data.get("profile", "default")
        zones = data.get("zones", DEFAULT_ZONES)
        if profile not in get_args(Profile) or not isinstance(zones, list | tuple) or not zones:
            return data  # the fields' own checks say what is wrong
        filled = dict(data)
        for section, preset in profile_preset(profile, [str(z) for z in zones]).items():
            given = filled.get(section)
            if given is None:
                filled[section] = preset
            elif isinstance(given, dict):
                filled[section] = {**preset, **given}
            # A section given as a model object is the spec's own, whole.
        return filled

    @model_validator(mode="before")
    @classmethod
    def _prices_moved_to_cost(cls, data: object) -> object:
        metrics = data.get("metrics") if isinstance(data, dict) else None
        if not isinstance(metrics, dict) or not set(metrics) & set(_OLD_PRICE_KEYS):
            return data
        assert isinstance(data, dict)
        cost = dict(data.get("cost") or {})
        metrics = dict(metrics)
        for old, new in _OLD_PRICE_KEYS.items():
            if old in metrics:
                if new in cost:
                    raise ValueError(f"metrics.{old} and cost.{new} both set: keep cost.{new}")
                cost[new] = metrics.pop(old)
        return {**data, "metrics": metrics, "cost": cost}

    @field_validator("host")
    @classmethod
    def _loopback_only(cls, host: str) -> str:
        if host not in {"127.0.0.1", "localhost", "::1"} and not host.startswith("127."):
            raise ValueError("host must be a loopback address (the local mesh binds nothing else)")
        return host

    @model_validator(mode="after")
    def _zone_names_are_no_edge_names(self) -> MeshSpec:
        clash = sorted(z for z in self.zones if z.startswith(ZONE_EDGE_PREFIX))
        if clash:
            raise ValueError(
                f"zones: {clash}: a zone name may not start with {ZONE_EDGE_PREFIX!r}, the "
                "prefix of the zones' edge Envoys"
            )
        return self

    @model_validator(mode="after")
    def _small_host_serves_every_zone_from_the_first(self) -> MeshSpec:
        if self.profile != "small-host":
            return self
        first = self.zones[0]
        for service in ("feature", "model_servers"):
            replicas: Replicas = getattr(self, service)
            elsewhere = sorted(z for z, n in replicas.per_zone.items() if n and z != first)
            if elsewhere:
                raise ValueError(
                    f"{service}.per_zone: profile small-host runs the {service} processes in "
                    f"the first zone ({first}) for every zone, not in {elsewhere}; leave "
                    f"{service} out of the spec, or use profile: default (a running mesh "
                    "changes its profile only when it starts again)"
                )
        return self

    @model_validator(mode="after")
    def _a_named_collector_needs_dns_discovery(self) -> MeshSpec:
        endpoint = self.tracing.otlp_endpoint
        if not endpoint or self.discovery.backend == "dns":
            return self
        host = endpoint.rpartition(":")[0].strip("[]")
        if host != "localhost" and not re.fullmatch(r"[\d.]+|[0-9a-fA-F:]+", host):
            raise ValueError(
                f"tracing.otlp_endpoint: {host} is a host name, which only discovery.backend "
                "dns has Envoy resolve; give the collector's address"
            )
        return self

    @model_validator(mode="after")
    def _replicas_in_known_zones(self) -> MeshSpec:
        for service in ("gateway", "feature", "model_servers"):
            replicas: Replicas = getattr(self, service)
            unknown = sorted(set(replicas.per_zone) - set(self.zones))
            if unknown:
                raise ValueError(f"{service}.per_zone: names unknown zones {unknown}")
            if sum(replicas.per_zone.values()) < 1:
                raise ValueError(f"{service}.per_zone: needs at least one replica")
        return self

    @model_validator(mode="after")
    def _pools_hold_models(self) -> MeshSpec:
        used = set(self.pool_names())
        named = {m.pool for m in self.models.values() if m.pool is not None}
        owners: dict[str, str] = {}
        for model, entry in sorted(self.models.items()):
            if entry.pool is not None:
                continue
            own = own_pool_name(model)
            # Two models on one pool only when asked for: a pool is a wall between models.
            if own in named or own in owners:
                other = owners.get(own) or "a model that names it"
                raise ValueError(
                    f"models.{model}.pool: its own pool would be {own!r}, which {other} "
                    f"already holds; to share it, say so (models.{model}.pool: {own}), else "
                    f"name another pool for it"
                )
            owners[own] = model
        for name, pool in sorted(self.pools.items()):
            if name not in used:
                raise ValueError(
                    f"pools.{name}: no model is placed on it (set models.<model>.pool: {name}, "
                    "or drop the entry)"
                )
            if pool.per_zone is None:
                continue
            unknown = sorted(set(pool.per_zone) - set(self.zones))
            if unknown:
                raise ValueError(f"pools.{name}.per_zone: names unknown zones {unknown}")
            if sum(pool.per_zone.values()) < 1:
                raise ValueError(f"pools.{name}.per_zone: needs at least one replica")
        return self

    @model_validator(mode="after")
    def _replicas_within_the_scaling_bounds(self) -> MeshSpec:
        if not self.scaling.enabled:
            return self
        for kind in SCALED_KINDS:
            policy = self.scaling.pool(kind)
            field_name = replicas_field(kind)
            for zone, count in sorted(self.declared_replicas(kind).per_zone.items()):
                # A zone with none of a kind is no pool: the scaler leaves it empty.
                if count and not policy.min <= count <= policy.max:
                    raise ValueError(
                        f"{field_name}.per_zone.{zone}: {count} is outside the scaler's "
                        f"bounds scaling.{field_name}.min {policy.min} .. max {policy.max}"
                    )
        return self

    def declared_replicas(self, kind: ScaledKind, pool: str = SHARED_POOL) -> Replicas:
        """The spec's replicas per zone of a kind (`gateway`, `feature`; model servers: of
        `pool`, `pools.<pool>.per_zone` else `model_servers`)."""
        if kind == "model":
            return MeshSpec.pool_replicas(self, pool)
        found: Replicas = getattr(self, replicas_field(kind))
        return found

    def replicas_of(self, kind: ScaledKind, pool: str = SHARED_POOL) -> Replicas:
        """Replicas per zone of a kind as they run (a declared spec: as declared)."""
        return self.declared_replicas(kind, pool)

    def scaled_pools(self) -> list[tuple[ScaledKind, str]]:
        """What the scaler scales, each on its own: every model pool, then the gateways and
        the feature services (pool "")."""
        models: list[tuple[ScaledKind, str]] = [("model", pool) for pool in self.pool_names()]
        return [*models, ("gateway", SHARED_POOL), ("feature", SHARED_POOL)]

    @property
    def registry_backup_dir(self) -> Path:
        """Where the registry's backups go (`registry.backup.directory`)."""
        given = self.registry.backup.directory
        return Path(given) if given else Path(self.state_dir) / "registry-backups"

    @property
    def registry_store_dir(self) -> Path:
        """The registry's store: metadata and artifacts (registry/store.py)."""
        return Path(self.state_dir) / "registry"

    def proxies(self) -> list[str]:
        """The mesh's Envoys by name: the edges' (edge_proxies) first, then, in the per-zone
        layout, one per zone, named by its zone."""
        zones = list(self.zones) if self.proxy.layout == "per_zone" else []
        return self.edge_proxies() + zones

    @property
    def edges_per_zone(self) -> bool:
        """Whether every zone has an edge Envoy of its own (proxy.edges, per-zone layout)."""
        return self.proxy.layout == "per_zone" and self.proxy.edges == "per_zone"

    def edge_proxies(self) -> list[str]:
        """The Envoys holding the edge listener: EDGE_PROXY (the first zone's), then with an
        edge per zone edge-<zone> for each other zone."""
        others = [zone_edge_proxy(z) for z in self.zones[1:]] if self.edges_per_zone else []
        return [EDGE_PROXY, *others]

    def zone_of_edge(self, proxy: str) -> str:
        """The zone an edge Envoy runs for (the first zone's for the single edge)."""
        if proxy == EDGE_PROXY:
            return self.zones[0]
        zone = proxy.removeprefix(ZONE_EDGE_PREFIX)
        if proxy not in self.edge_proxies():
            raise ValueError(f"no edge Envoy named {proxy!r}; edges: {self.edge_proxies()}")
        return zone

    def registry_mirror_zones(self) -> list[str]:
        """The zones that run a mirror of the registry (registry.mirrors per_zone): every
        zone but the registry's own (the first)."""
        if self.registry.mirrors != "per_zone":
            return []
        return list(self.zones[1:])

    def proxy_of_zone(self, zone: str) -> str:
        """The Envoy holding `zone`'s mesh listener and clusters."""
        return zone if self.proxy.layout == "per_zone" else EDGE_PROXY

    def scaled_zones(self, kind: ScaledKind = "model", pool: str = SHARED_POOL) -> list[str]:
        """The zones whose replicas of `kind` (model servers: of `pool`) the scaler manages:
        those the spec gives any."""
        declared = self.declared_replicas(kind, pool).per_zone
        return [z for z in self.zones if declared.get(z, 0) > 0]

    def dns_name_of(self, instance: Instance) -> str:
        """The host name Envoy looks `instance` up under with `discovery.backend: dns`: its
        pool's `discovery.dns_names` pattern, else its kind's, else "{host}" (its
        discovery.hosts name, else host)."""
        names = self.discovery.dns_names
        pattern = names.get(instance.pool) if instance.pool else None
        pattern = pattern or names.get(instance.service, "{host}")
        return pattern.format(
            host=self.discovery.hosts.get(instance.name, self.host),
            instance=instance.name,
            kind=instance.service,
            pool=instance.pool,
            zone=instance.zone,
            mesh=self.name,
        )

    @model_validator(mode="after")
    def _dns_names_name_known_groups(self) -> MeshSpec:
        names = self.discovery.dns_names
        pools = set(self.pools) | set(self.pool_names())
        groups = set(get_args(ServiceKind)) | (pools - {SHARED_POOL})
        unknown = sorted(set(names) - groups)
        if unknown:
            raise ValueError(
                f"discovery.dns_names: names no service kind or model-server pool "
                f"({sorted(groups)}): {unknown}"
            )
        if self.discovery.backend != "dns":
            return self
        for instance in self.instances():
            problem = host_name_problem(self.dns_name_of(instance))
            if problem:
                key = instance.pool if instance.pool in names else instance.service
                field = f"dns_names.{key}" if key in names else "hosts (or host)"
                raise ValueError(f"discovery.{field}: for {instance.name}: {problem}")
        return self

    @model_validator(mode="after")
    def _hosts_name_known_parts(self) -> MeshSpec:
        envoys = {proxy_part(proxy) for proxy in self.proxies()}
        mirrors = {registry_mirror_name(zone) for zone in self.registry_mirror_zones()}
        known = {i.name for i in self.instances()} | envoys | mirrors
        embedded = getattr(self, "embedded_trace_store_port", None) is not None  # resolved
        if self.tracing.enabled and (embedded or not self.tracing.otlp_endpoint):
            known.add(TRACE_STORE_PART)  # the mesh's own trace store
        unknown = sorted(set(self.discovery.hosts) - known)
        if unknown:
            raise ValueError(
                f"discovery.hosts: names no instance, Envoy ({sorted(envoys)}), registry "
                f"mirror ({sorted(mirrors)}) or the mesh's "
                f"trace store ({TRACE_STORE_PART}, with tracing on and no collector named): "
                f"{unknown}"
            )
        return self

    @model_validator(mode="after")
    def _models_read_known_views(self) -> MeshSpec:
        for name, model in self.models.items():
            for tensor, spec in model.effective_inputs.items():
                if spec.view is None or spec.features is None:
                    continue
                # The shorthand's errors name its own fields.
                where = (
                    f"models.{name}" if model.inputs is None else f"models.{name}.inputs.{tensor}"
                )
                view_field = "feature_view" if model.inputs is None else "view"
                view = self.feature_views.get(spec.view)
                if view is None:
                    raise ValueError(
                        f"{where}.{view_field}: {spec.view!r} is not one of "
                        f"feature_views {sorted(self.feature_views)}"
                    )
                if view.features is not None:
                    lacking = [f for f in spec.features if f not in set(view.features)]
                    if lacking:
                        raise ValueError(
                            f"{where}.features: not in feature view {spec.view!r}: {lacking[:10]}"
                        )
        return self

    @model_validator(mode="after")
    def _streams_name_known_models(self) -> MeshSpec:
        names = [s.name for s in self.streams]
        twice = sorted(n for n, count in Counter(names).items() if count > 1)
        if twice:
            raise ValueError(f"streams: names used more than once: {twice}")
        for i, stream in enumerate(self.streams):
            model = self.models.get(stream.model)
            if model is None:
                raise ValueError(
                    f"streams[{i}].model: {stream.model!r} is not one of models "
                    f"{sorted(self.models)}"
                )
            if stream.version is not None and stream.version not in model.versions:
                raise ValueError(
                    f"streams[{i}].version: {stream.version!r} is not a version of "
                    f"{stream.model!r}: {sorted(model.versions)}"
                )
            keys = [stream.input_key, stream.output_key, stream.dead_letter_key]
            if len(set(keys)) != 3:
                raise ValueError(f"streams[{i}]: input, output and dead_letter must differ")
            if stream.password_file is not None and stream.redis_url is None:
                raise ValueError(f"streams[{i}].password_file: only with redis_url")
        return self

    @model_validator(mode="after")
    def _batch_jobs_name_known_models(self) -> MeshSpec:
        names = [j.name for j in self.batch]
        twice = sorted(n for n, count in Counter(names).items() if count > 1)
        if twice:
            raise ValueError(f"batch: names used more than once: {twice}")
        for i, job in enumerate(self.batch):
            model = self.models.get(job.model)
            if model is None:
                raise ValueError(
                    f"batch[{i}].model: {job.model!r} is not one of models {sorted(self.models)}"
                )
            if job.version is not None and job.version not in model.versions:
                raise ValueError(
                    f"batch[{i}].version: {job.version!r} is not a version of "
                    f"{job.model!r}: {sorted(model.versions)}"
                )
            if job.view is not None and job.view not in model.views:
                raise ValueError(
                    f"batch[{i}].view: model {job.model!r} reads {model.views}, not {job.view!r}"
                )
        return self

    @model_validator(mode="after")
    def _precomputed_tiers_name_redis_jobs(self) -> MeshSpec:
        for name, model in self.models.items():
            tier = model.tiers.precomputed if model.tiers else None
            if tier is None or not tier.source.startswith("batch."):
                continue
            job_name = tier.source.removeprefix("batch.")
            where = f"models.{name}.tiers.precomputed.from"
            job = next((j for j in self.batch if j.name == job_name), None)
            if job is None:
                known = [j.name for j in self.batch]
                raise ValueError(f"{where}: no batch job named {job_name!r}; known: {known}")
            if job.model != name or job.output != "redis":
                raise ValueError(
                    f"{where}: batch job {job_name!r} scores {job.model!r} into {job.output!r}; "
                    f"the tier reads a job scoring {name!r} into redis"
                )
        return self

    def batch_job(self, name: str) -> BatchJobSpec:
        for job in self.batch:
            if job.name == name:
                return job
        known = [j.name for j in self.batch]
        raise SpecError(f"no batch job named {name!r} in the spec's batch; known: {known}")

    def stream(self, name: str) -> StreamSpec:
        for stream in self.streams:
            if stream.name == name:
                return stream
        known = [s.name for s in self.streams]
        raise SpecError(f"no stream named {name!r} in the spec's streams; known: {known}")

    def entity_of(self, view: str) -> str:
        """The entity `view` is keyed by: its `entity`, else its own name."""
        spec = self.feature_views.get(view)
        if spec is None:
            raise SpecError(f"no feature view named {view!r}; views: {sorted(self.feature_views)}")
        return spec.entity or view

    def entities_of(self, model: ModelSpec) -> list[str]:
        """The entities whose ids a request for `model` names, in the order its views are read."""
        found: list[str] = []
        for view in model.views:
            entity = self.entity_of(view)
            if entity not in found:
                found.append(entity)
        return found

    # --- derived views -------------------------------------------------------------

    def instances(self) -> list[Instance]:
        """Every service process of the mesh, in start order (registry first)."""
        found = [Instance(name=REGISTRY_INSTANCE, service="registry", zone=self.zones[0])]
        found += self._model_instances()
        kinds: tuple[FrontKind, ...] = ("feature", "gateway")
        for service in kinds:
            replicas = self.replicas_of(service)
            for zone in self.zones:
                for index in range(replicas.per_zone.get(zone, 0)):
                    found.append(
                        Instance(
                            name=instance_name(service, zone, index), service=service, zone=zone
                        )
                    )
        return found

    def _model_instances(self) -> list[Instance]:
        """The model servers: one set, each pool as many per zone as it has (a running mesh
        may hold more, see ResolvedSpec.fleet)."""
        return [
            inst
            for pool in self.pool_names()
            for inst in model_set_instances("", self.zones, self.pool_replicas(pool), pool)
        ]

    def pool_of(self, model: str) -> str:
        """The pool that serves `model`: the one it names, else its own."""
        spec = self.models.get(model)
        if spec is not None and spec.pool is not None:
            return spec.pool
        return own_pool_name(model)

    def pool_names(self) -> list[str]:
        """Every pool a model is placed on, by name (a mesh with no model: SHARED_POOL, the
        model servers that load nothing)."""
        if not self.models:
            return [SHARED_POOL]
        return sorted({self.pool_of(model) for model in self.models})

    def pool_models(self, pool: str) -> list[str]:
        """The models a pool serves, by name."""
        return sorted(name for name in self.models if self.pool_of(name) == pool)

    def pool_replicas(self, pool: str) -> Replicas:
        """Model servers per zone of a pool as declared: `pools.<pool>.per_zone`, else
        `model_servers.per_zone` (a running mesh's scaler may have set others, see
        ResolvedSpec.pool_replicas)."""
        settings = self.pools.get(pool) if pool else None
        if settings is not None and settings.per_zone is not None:
            return Replicas.model_construct(per_zone=dict(settings.per_zone))
        return self.model_servers

    def instance(self, name: str) -> Instance:
        for inst in self.instances():
            if inst.name == name:
                return inst
        raise SpecError(f"no instance named {name!r}; known: {[i.name for i in self.instances()]}")
