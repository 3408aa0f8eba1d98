"""The online store's side of the spec: the feature views (`feature_views:`), the store
they are read from (`feature_store:`), and its password file in the state dir."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from servemesh.spec.base import Name, _Strict
from servemesh.spec.durations import Duration, duration_seconds

FeatureName = Annotated[str, Field(min_length=1, max_length=64)]


class FeatureViewSpec(_Strict):
    """One feature view: what a loaded row of it holds, and when a stored row is too old.

    `servemesh features load FILE --view NAME --key COLUMN` replaces the view with the file
    (docs/features.md); the feature service reads it for the models that name it.
    """

    # The entity the view is keyed by (a request names an id per entity); null: the view's
    # own name. Views of one entity share its ids.
    entity: Name | None = None
    # The features of a row, in the order they are stored and served; a file loaded into
    # the view has exactly these columns besides its key (and timestamp), in any order.
    # null: the view takes every other column of the file it is loaded from, in the
    # file's order (each load may change them).
    features: list[FeatureName] | None = None
    # A row older than this, by its event time (the file's --timestamp column, else the
    # time it was loaded), is stale. null: rows never go stale.
    max_age: Duration | None = None
    # What a read of a stale row answers:
    #   error     FAILED_PRECONDITION naming the entity and its age
    #   default   the view's defaults, with `defaulted` and `stale` set
    #   degraded  the stored values, with `stale` set for the gateway to surface
    staleness: Literal["error", "default", "degraded"] = "error"
    # May a loaded value be NaN (an empty cell loads as NaN)? Infinities never load.
    allow_nan: bool = False
    # Values answered for a missing entity (feature_store.missing_entity: defaults) or a
    # stale one (staleness: default), per feature; the rest get feature_store.default_value.
    defaults: dict[FeatureName, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> FeatureViewSpec:
        if self.features is not None:
            repeated = sorted({f for f in self.features if self.features.count(f) > 1})
            if repeated:
                raise ValueError(f"features: named more than once: {repeated}")
            if not self.features:
                raise ValueError("features: give at least one, or null for the file's columns")
            unknown = sorted(set(self.defaults) - set(self.features))
            if unknown:
                raise ValueError(f"defaults: not features of the view: {unknown}")
        if self.max_age is not None and duration_seconds(self.max_age) <= 0:
            raise ValueError("max_age: must be longer than 0 (null: rows never go stale)")
        return self

    @property
    def max_age_ms(self) -> int | None:
        """max_age in milliseconds; None when rows never go stale."""
        if self.max_age is None:
            return None
        return round(duration_seconds(self.max_age) * 1000)


class FeatureStoreSpec(_Strict):
    # None: `servemesh up` starts its own redis-server on a free port, with a password.
    # The URL is printed (endpoints.json, the resolved spec): never put a password in it.
    redis_url: str | None = None
    # A file whose first line is the Redis password (keep it owner-only). The launcher's
    # own Redis always has one: `<state_dir>/redis-password`, set when the spec resolves.
    password_file: str | None = None
    # What to do with an entity missing from the store: "error" answers NOT_FOUND naming
    # it; "defaults" answers the view's default values with `defaulted` set.
    missing_entity: Literal["error", "defaults"] = "error"
    default_value: float = 0.0
    key_prefix: Annotated[str, Field(min_length=1, max_length=64)] = "fs"
    # single: one Redis serves every zone. replicated (the launcher's own Redis only): a
    # primary, a replica and a Sentinel per zone; each zone's feature services read their
    # zone's replica and write to the primary the Sentinels name (docs/features.md).
    topology: Literal["single", "replicated"] = "single"
    # How long a primary may not answer before a Sentinel calls it down; with an election
    # (about a second) and the promotion, the failover's time. Lower fails over sooner and
    # risks failing over a primary that was only busy.
    sentinel_down_after_ms: Annotated[int, Field(ge=100, le=60_000)] = 2000
    # Sentinel's failover-timeout: how long before a failover that stalled is tried again,
    # and the bound on moving the other replicas to the new primary.
    sentinel_failover_timeout_ms: Annotated[int, Field(ge=1000, le=600_000)] = 8000
    # One more Sentinel, in no zone, where the zones' own cannot outvote a lost zone's (an
    # even number of zones): with two, a lost zone takes one Sentinel of two with it, the
    # other is no majority, and a primary lost with that zone is never replaced. On one host
    # the witness is one more process; across hosts, run it where neither zone's loss takes
    # it too.
    witness_sentinel: bool = True


# The name a replicated store's Sentinels know it by (clients ask them for its primary).
SENTINEL_MASTER_NAME = "servemesh"
# The witness Sentinel's name among the store's ports (the zones' are "sentinel-<zone>").
WITNESS_SENTINEL = "sentinel-witness"


def sentinel_names(zones: list[str], witness: bool) -> list[str]:
    """The Sentinels of a replicated store over `zones`: one per zone, and the witness where
    the zones are even in number and it is wanted."""
    names = [f"sentinel-{zone}" for zone in zones]
    return [*names, WITNESS_SENTINEL] if witness and len(zones) % 2 == 0 else names


# The embedded Redis's password, in the state dir (owner-only; created by the launcher).
REDIS_PASSWORD_FILE = "redis-password"
