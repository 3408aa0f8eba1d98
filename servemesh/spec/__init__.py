"""The mesh spec (`mesh.yaml`): its typed model, how it is read, checked and resolved, and
the policies it carries. Callers import from here; the modules below are its sections,
each importing only those above it in this list:

- base.py: SpecError, the strict model every section is built on, names, ports, kinds
- features.py: feature views and the online store (`feature_views:`, `feature_store:`)
- models.py: models, their versions, inputs, batching and tiers, the gateway's
  coalescing, pools of model servers and how pools are named (`models:`, `pools:`)
- network.py: zones' networking, the Envoy layout, TLS, discovery, ports, and the free
  ports resolving picks (`network:`, `proxy:`, `tls:`, `discovery:`, `ports:`)
- observability.py: logs, the prediction log, traces, metrics, cost
- services.py: limits, deadlines, the demo seeding, the registry's settings, the model
  servers' sandbox and quarantine
- workloads.py: streaming predictions and scheduled batch runs (`streams:`, `batch:`)
- fleet.py: replicas, instances and their names, a running mesh's model-server sets
- mesh.py: MeshSpec, what a spec file declares, its checks across sections, profiles
- resolve.py: ResolvedSpec (a running mesh), resolve, declared, with_profile, and
  parsing, loading and dumping specs

The policies the spec carries sit beside them: policy.py (`traffic:`, what Envoy does on
each route and cluster), durations.py, rollout_plan.py (`rollout:`, a rollout's steps and
gates), scaling_policy.py (`scaling:`, what the scaler holds each pool to), and
model_contract.py (whether a model's entry fits an artifact's signature)."""

from servemesh.spec.base import (
    SCALED_KINDS,
    FrontKind,
    Name,
    Port,
    ScaledKind,
    ServiceKind,
    SpecError,
    ZoneName,
)
from servemesh.spec.features import (
    REDIS_PASSWORD_FILE,
    SENTINEL_MASTER_NAME,
    WITNESS_SENTINEL,
    FeatureName,
    FeatureStoreSpec,
    FeatureViewSpec,
)
from servemesh.spec.fleet import (
    FLEET_STATUS_FILE,
    REGISTRY_INSTANCE,
    FleetState,
    Instance,
    Replicas,
    ReplicaSet,
    SetName,
    instance_name,
    model_instance_name,
    model_set_instances,
    replicas_field,
)
from servemesh.spec.mesh import (
    DEFAULT_ZONES,
    MeshSpec,
    Profile,
    Spec,
    profile_preset,
)
from servemesh.spec.models import (
    POOL_NAME_PATTERN,
    PRECOMPUTED_SOURCE,
    SHARED_POOL,
    SHORTHAND_INPUT,
    BatchingSpec,
    CacheTierSpec,
    CoalescingSpec,
    ModelInputSpec,
    ModelSpec,
    ModelVersionSpec,
    PoolName,
    PoolSpec,
    PrecomputedTierSpec,
    TensorName,
    TiersSpec,
    own_pool_name,
    scaled_pool_label,
)
from servemesh.spec.network import (
    EDGE_PROXY,
    ENVOY_PART,
    RESERVATION_S,
    DiscoverySpec,
    NetworkSpec,
    Ports,
    ProxySpec,
    TlsSpec,
    free_port,
    is_edge_proxy,
    proxy_part,
    zone_edge_proxy,
)
from servemesh.spec.observability import (
    SCALER_TARGETS_FILE,
    STREAM_TARGETS_GLOB,
    TRACE_STORE_PART,
    CostSpec,
    LogsSpec,
    MetricsSpec,
    OtlpEndpoint,
    PredictionLogSpec,
    TraceRetention,
    TracingSpec,
)
from servemesh.spec.resolve import (
    RESOLVED_FIELDS,
    ResolvedSpec,
    declared,
    dump_spec,
    load_resolved,
    load_spec,
    parse_resolved,
    parse_spec,
    parse_spec_or_resolved,
    resolve,
    with_profile,
)
from servemesh.spec.services import (
    Deadlines,
    DemoSpec,
    Limits,
    LivenessSpec,
    ProcessesSpec,
    QuarantineSpec,
    RegistryBackupSpec,
    RegistrySpec,
    SandboxSpec,
)
from servemesh.spec.workloads import (
    CRON_MACROS,
    BatchJobSpec,
    StreamKey,
    StreamSpec,
)

__all__ = [
    "TRACE_STORE_PART",
    "BatchingSpec",
    "BatchJobSpec",
    "CacheTierSpec",
    "CoalescingSpec",
    "CostSpec",
    "CRON_MACROS",
    "Deadlines",
    "declared",
    "DEFAULT_ZONES",
    "DemoSpec",
    "DiscoverySpec",
    "dump_spec",
    "EDGE_PROXY",
    "zone_edge_proxy",
    "ENVOY_PART",
    "FeatureName",
    "FeatureStoreSpec",
    "FeatureViewSpec",
    "FLEET_STATUS_FILE",
    "FleetState",
    "free_port",
    "is_edge_proxy",
    "FrontKind",
    "Instance",
    "instance_name",
    "Limits",
    "LivenessSpec",
    "load_resolved",
    "load_spec",
    "LogsSpec",
    "MeshSpec",
    "MetricsSpec",
    "model_instance_name",
    "model_set_instances",
    "ModelInputSpec",
    "ModelSpec",
    "ModelVersionSpec",
    "Name",
    "NetworkSpec",
    "OtlpEndpoint",
    "own_pool_name",
    "parse_resolved",
    "parse_spec",
    "parse_spec_or_resolved",
    "POOL_NAME_PATTERN",
    "PoolName",
    "PoolSpec",
    "Port",
    "Ports",
    "PRECOMPUTED_SOURCE",
    "PrecomputedTierSpec",
    "PredictionLogSpec",
    "Profile",
    "profile_preset",
    "proxy_part",
    "ProxySpec",
    "QuarantineSpec",
    "REDIS_PASSWORD_FILE",
    "SENTINEL_MASTER_NAME",
    "WITNESS_SENTINEL",
    "REGISTRY_INSTANCE",
    "RegistryBackupSpec",
    "RegistrySpec",
    "Replicas",
    "replicas_field",
    "ReplicaSet",
    "RESERVATION_S",
    "resolve",
    "RESOLVED_FIELDS",
    "ResolvedSpec",
    "ProcessesSpec",
    "SandboxSpec",
    "SCALED_KINDS",
    "scaled_pool_label",
    "ScaledKind",
    "SCALER_TARGETS_FILE",
    "ServiceKind",
    "SetName",
    "SHARED_POOL",
    "SHORTHAND_INPUT",
    "Spec",
    "SpecError",
    "STREAM_TARGETS_GLOB",
    "StreamKey",
    "StreamSpec",
    "TensorName",
    "TiersSpec",
    "TlsSpec",
    "TraceRetention",
    "TracingSpec",
    "with_profile",
    "ZoneName",
]
