"""How the services run: what they accept (`limits:`), deadlines (`deadlines:`), the demo
seeding (`demo:`), the registry's own settings (`registry:`), and the model servers'
sandbox and quarantine (`sandbox:`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from servemesh.spec.base import _Strict
from servemesh.spec.durations import Duration, duration_seconds


class Limits(_Strict):
    # gRPC messages above this are refused with RESOURCE_EXHAUSTED by every service.
    max_message_bytes: Annotated[int, Field(ge=1024, le=256 * 1024 * 1024)] = 4 * 1024 * 1024
    # Registry uploads above this are refused.
    max_artifact_bytes: Annotated[int, Field(ge=1024, le=16 * 1024**3)] = 512 * 1024 * 1024
    # Bytes the registry stores in all (distinct artifacts); an upload that would pass it is
    # refused before its bytes arrive.
    registry_quota_bytes: Annotated[int, Field(ge=1024, le=1024**5)] = 8 * 1024**3
    # An upload that sends no message for this long is aborted (DEADLINE_EXCEEDED), and
    # leaves nothing behind.
    upload_idle_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # Entities plus rows in one Predict.
    max_rows_per_predict: Annotated[int, Field(ge=1, le=65536)] = 1024
    # Feature names one GetFeatures may ask for, and entities x features it may read.
    max_feature_names: Annotated[int, Field(ge=1, le=65536)] = 1024
    max_feature_cells: Annotated[int, Field(ge=1, le=64 * 1024 * 1024)] = 1024 * 1024


class Deadlines(_Strict):
    # Time each hop keeps for itself (answering, serialising) before calling downstream.
    hop_budget_ms: Annotated[float, Field(ge=0, le=1000)] = 2.0
    # Deadline applied to calls that arrive without one.
    default_timeout_ms: Annotated[float, Field(gt=0, le=600_000)] = 5000.0


class DemoSpec(_Strict):
    # Seed the registry with the demo models and Redis with demo features on `up`.
    enabled: bool = True
    entities: Annotated[int, Field(ge=0, le=1_000_000)] = 5000


class RegistryBackupSpec(_Strict):
    """Scheduled backups of the registry's store, taken by the registry process itself
    (`servemesh registry backup` takes one by hand; docs/registry.md)."""

    # How often; null: never on a schedule.
    interval: Duration | None = None
    # Where the snapshots and artifacts go; null: <state_dir>/registry-backups.
    directory: str | None = None
    # The newest this many snapshots are kept (and the artifacts they name).
    keep: Annotated[int, Field(ge=1, le=10_000)] = 7

    @property
    def interval_s(self) -> float | None:
        return None if self.interval is None else duration_seconds(self.interval)


class RegistrySpec(_Strict):
    backup: RegistryBackupSpec = Field(default_factory=RegistryBackupSpec)
    # per_zone: every zone but the registry's (the first) runs a read-only mirror of it
    #           (servemesh.registry.mirror) with a store of its own, kept in step by pulling
    #           from the registry; that zone's model servers fetch from the mirror when the
    #           registry does not answer, so they start and load with the registry's zone
    #           gone. Pushes, aliases and new models go to the registry alone.
    # none:     the registry alone.
    # Mirrors run where `servemesh up` runs the mesh (discovery.backend file).
    mirrors: Literal["per_zone", "none"] = "per_zone"
    # How often a mirror pulls what the registry has that it lacks (a miss is also pulled
    # at once, when the registry answers).
    mirror_sync: Duration = "2s"

    @property
    def mirror_sync_s(self) -> float:
        return duration_seconds(self.mirror_sync)


class QuarantineSpec(_Strict):
    """When the launcher takes a version's traffic away because its calls keep crashing
    their model servers (servemesh/quarantine.py, docs/operators.md "Quarantine")."""

    # A (model, version) in flight in `crashes` model server crashes within `within` is
    # quarantined: its weight goes to 0, its share to the model's last good version.
    # false: crashes are still recorded (<state_dir>/crashes.jsonl), traffic never moves.
    enabled: bool = True
    crashes: Annotated[int, Field(ge=1, le=1000)] = 3
    within: Duration = "5m"


class LivenessSpec(_Strict):
    """When the launcher restarts a model server that is running but no longer alive: its
    event loop does not answer, or a model's thread has been in one call for `stall`
    (services/model/checks.py). Readiness takes such a replica out of Envoy within seconds;
    liveness gives the pool its replica back, since a stuck Python thread cannot be freed
    from outside its process (servemesh/procs/liveness.py)."""

    # false: liveness is still reported (the health name `liveness`), never acted on.
    enabled: bool = True
    # A call in a model's thread for this long means the thread is stuck for good. Keep it
    # above the slowest batch a caller may wait for (deadlines are capped at 60 s).
    stall: Duration = "30s"
    # How often the launcher asks each model server, and how many answers in a row must
    # fail (no answer within `timeout`, or NOT_SERVING) before it kills the process, which
    # the mesh then starts again with crash-loop backoff (a restart, counted and shown).
    period: Duration = "5s"
    timeout: Duration = "2s"
    failures: Annotated[int, Field(ge=1, le=100)] = 3

    @property
    def stall_s(self) -> float:
        return duration_seconds(self.stall)

    @property
    def period_s(self) -> float:
        return duration_seconds(self.period)

    @property
    def timeout_s(self) -> float:
        return duration_seconds(self.timeout)


class SandboxSpec(_Strict):
    # The user model servers run as when `servemesh up` runs as root (a model file is code):
    # auto: uid/gid 61000; off: root, like the rest; or a uid, uid:gid or user name.
    # Not root, every process is the mesh's user (servemesh.procs.sandbox).
    model_user: str = "auto"
    # Model servers confine themselves once their first models loaded: no new processes or
    # programs, no ptrace, no signals to others, no changes of modes or owners, no core
    # dumps (services/runtime/confine.py, profile "server"); false only to debug a model
    # server with a tracer.
    syscall_filter: bool = True
    # The address space a model server may map (RLIMIT_AS), in GiB: torch, the server's
    # threads (each maps a malloc arena) and the pool's models. A model that allocates past
    # it fails its batch with an error instead of taking the host's memory.
    model_address_space_gib: Annotated[int, Field(ge=2, le=4096)] = 32
    # A version whose calls keep crashing its servers loses its traffic (QuarantineSpec).
    quarantine: QuarantineSpec = Field(default_factory=QuarantineSpec)
    # A model server that runs but no longer answers is killed and started again.
    liveness: LivenessSpec = Field(default_factory=LivenessSpec)


class ProcessesSpec(_Strict):
    """How `servemesh up` starts the mesh's own Python services."""

    # true: the registry, gateway, feature, trace-store and scaler processes are forked from
    # one interpreter that has imported them already (servemesh.procs.forkserver), about a
    # second of CPU less for each at every start and restart; model servers running as their
    # pool's user are forked from a server of that user's own; anything in a zone's network
    # namespace is exec'd. false: every process is exec'd.
    fork_server: bool = True
