"""A mesh's processes: replicas per zone, each service instance and how it is named, and
how a running mesh's model servers are arranged (replica sets, draining, standbys, the
scaler's counts) with the file the launcher records them in."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from servemesh.spec.base import FrontKind, Name, ScaledKind, ServiceKind, ZoneName, _Strict
from servemesh.spec.models import SHARED_POOL

# The mesh's one registry process.
REGISTRY_INSTANCE = "registry-0"
# A zone's mirror of the registry (registry.mirrors): its process, identity and store name.
REGISTRY_MIRROR_PREFIX = "registry-mirror-"


def registry_mirror_name(zone: str) -> str:
    return f"{REGISTRY_MIRROR_PREFIX}{zone}"


class Replicas(_Strict):
    """How many processes of a service run in each zone."""

    per_zone: dict[ZoneName, Annotated[int, Field(ge=0, le=16)]] = Field(
        default_factory=lambda: {"zone-a": 1, "zone-b": 1}
    )


class Instance(_Strict):
    name: str
    service: ServiceKind
    zone: ZoneName
    # The model-server set it belongs to ("" the first; see FleetState). Other services: "".
    replica_set: str = ""
    # The pool of model servers it belongs to (a model server's). Others: "".
    pool: str = ""


SetName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9]{0,15}$")]


def replicas_field(kind: ScaledKind) -> str:
    """The spec's field (and the scaling policy's) holding a kind's replicas."""
    return "model_servers" if kind == "model" else kind


def instance_name(kind: ScaledKind, zone: str, index: int, pool: str = SHARED_POOL) -> str:
    """The name of a kind's `index`-th replica in `zone` (a model server: of `pool`, in the
    first set)."""
    if kind == "model":
        return model_instance_name("", zone, index, pool)
    return f"{kind}-{zone}-{index}"


def model_instance_name(set_name: str, zone: str, index: int, pool: str = SHARED_POOL) -> str:
    """model-<zone>-<i> in the set named "" (the mesh's first), model-<set>-<zone>-<i> in
    any other; a pool's servers put the pool's name first (model-<pool>-<zone>-<i>). The
    prefix `model-` is what Envoy's certificate check asks of a model server."""
    parts = [part for part in ("model", pool, set_name, zone, str(index)) if part]
    return "-".join(parts)


def model_set_instances(
    set_name: str, zones: list[str], replicas: Replicas, pool: str = SHARED_POOL
) -> list[Instance]:
    return [
        Instance(
            name=model_instance_name(set_name, zone, index, pool),
            service="model",
            zone=zone,
            replica_set=set_name,
            pool=pool,
        )
        for zone in zones
        for index in range(replicas.per_zone.get(zone, 0))
    ]


class ReplicaSet(_Strict):
    """A set of model servers, in each of its pools as many per zone as the pool has. Each
    loads every version its pool holds, like any model server."""

    # "" names the set a mesh starts with; a blue-green update names the other one.
    name: Literal[""] | SetName = ""
    # The versions whose clusters list this set's replicas instead of the first set's, by
    # model (a blue-green update's new version, on its green set).
    serves: dict[Name, list[Name]] = Field(default_factory=dict)
    # The pools it has replicas in: a blue-green update's set, only the updated model's
    # pool (no other pool starts a replica or loses one); None, every pool (the first set).
    pools: list[Name] | None = None


class FleetState(_Strict):
    """How a running mesh's model servers are arranged beyond what a spec file declares:
    what blue-green and rolling updates (servemesh.rollout.fleet) change live, and what the
    launcher follows by starting and stopping replicas."""

    # The first set serves every version no other set serves; a second set exists while a
    # blue-green update runs, until the old set is retired.
    sets: list[ReplicaSet] = Field(default_factory=lambda: [ReplicaSet()], min_length=1)
    # Replicas Envoy is told are draining (EDS health DRAINING): no new calls reach them,
    # calls in flight finish. A rolling update takes one at a time out this way.
    draining: list[str] = Field(default_factory=list)
    # How many times a rolling update asked for a replica to be replaced, by instance; the
    # launcher restarts a replica whose number went up.
    generations: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    # Model servers per zone of each pool as the scaler set them (servemesh.scaling); a pool
    # not here: the spec's `pools.<pool>.per_zone`, else `model_servers.per_zone`. Every
    # set has this many per zone.
    model_pools: dict[str, dict[ZoneName, Annotated[int, Field(ge=0, le=16)]]] = Field(
        default_factory=dict
    )
    # Gateways and feature services per zone as the scaler set them, by kind; a kind not
    # here: the spec's `gateway.per_zone` / `feature.per_zone`.
    pools: dict[FrontKind, dict[ZoneName, Annotated[int, Field(ge=0, le=16)]]] = Field(
        default_factory=dict
    )
    # Replicas started but out of rotation (Envoy is told DRAINING, so no call reaches them):
    # a replica the scaler added, until it is ready (a model server: holds every version),
    # and the pools' warm standbys. Any kind but the registry.
    standby: list[str] = Field(default_factory=list)

    # The name a pool's replicas of the first set carry once a blue-green update of that
    # pool was retired (its new set took the pool over, under its own name); a pool not
    # here: the first set's name. The other pools' replicas never change name or process.
    homes: dict[Name, Literal[""] | SetName] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _sets_apart(self) -> FleetState:
        if self.sets[0].pools is not None or self.sets[0].serves:
            raise ValueError("sets[0]: the first set spans every pool and serves the rest")
        for index, one in enumerate(self.sets):
            for other in self.sets[index + 1 :]:
                shared = _overlap(one.pools, other.pools)
                if one.name == other.name and shared:
                    raise ValueError(
                        f"sets: two sets named {one.name or 'first'!r} share pools {shared}"
                    )
        return self

    def sets_in(self, pool: str) -> list[ReplicaSet]:
        """The sets after the first with replicas in `pool` (a blue-green update's)."""
        return [s for s in self.sets[1:] if s.pools is None or pool in s.pools]

    def home_of(self, pool: str) -> str:
        """The set name `pool`'s replicas of the first set carry."""
        return self.homes.get(pool, self.sets[0].name)


def _overlap(one: list[str] | None, other: list[str] | None) -> list[str]:
    """The pools two sets share ("every pool" for a set of every pool)."""
    if one is None or other is None:
        return sorted(other or one or ["every pool"])
    return sorted(set(one) & set(other))


# What the running mesh started of its model-server fleet, by instance (PID, generation):
# written by the launcher in the state dir, read by blue-green and rolling updates.
FLEET_STATUS_FILE = "fleet-status.json"
