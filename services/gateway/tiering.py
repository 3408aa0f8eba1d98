"""A gateway's tiers (precomputed, cache, the change feed) behind one object.

The gateway's Predict (services/gateway/service.py) calls `Tiers` at its points on the
way and nowhere else:

1. `begin`, before the feature read: which tiers the call may use, the version it would be
   routed to, what the feature read asks for (GetFeaturesRequest.tier), and, for a cache
   that follows the change feed, an answer on the feed's word before any call;
2. `before_online`, after the feature read: the precomputed answer, else the cache's
   (`read_failed` when the read that carried the tier state failed);
3. `after_online`: the model's answer kept in the cache;

and the feed's follower (app.py) calls `wants_feed`, `feed_changed` and `feed_broke`.
The pure pieces (which calls, the cache, keys, rows, answers) are in tiers.py; docs/tiers.md
says what each tier does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from servemesh.services.gateway.feed import ChangeKey, FeedMark, FeedState
from servemesh.services.gateway.metrics import PredictMetrics
from servemesh.services.gateway.predict import ModelSignature, PredictPlan
from servemesh.services.gateway.tiers import (
    FEED_ONLINE,
    FEED_PRECOMPUTED,
    HIT,
    MISS,
    SKIPPED,
    STALE,
    AnswerCache,
    CacheKey,
    TierState,
    cache_keys,
    feed_keys,
    precomputed_rows,
    response_of,
    rows_of,
    tiers_for,
)
from servemesh.spec import CacheTierSpec, MeshSpec, TiersSpec
from servemesh_api.gateway.v1 import gateway_pb2

# A tiered call's read also asks for its model version's tier state (model, version,
# whether precomputed answers are read): GetFeaturesRequest.tier.
TierKey = tuple[str, str, bool]
# How fresh each row read is: the view's version and each entity's event time (ms), which
# the cache keys on.
Fresh = tuple[int, list[int]]


@dataclass
class TierCall:
    """One Predict's way through its model's tiers (no tiers: `tiers` is None)."""

    plan: PredictPlan
    tiers: TiersSpec | None = None
    version: str | None = None  # the version the call would be routed to, when known
    # Set when the cache follows the feed: whether an answer made now may be kept.
    mark: FeedMark | None = None
    # An answer given before any call, on the feed's word.
    answer: gateway_pb2.PredictResponse | None = None
    # Where the online answer is kept, and under which keys (no cache: not kept).
    cache: AnswerCache | None = None
    keys: list[CacheKey] = field(default_factory=list)

    @property
    def key(self) -> TierKey | None:
        """The tier state the feature read asks for; None: none (the call goes online)."""
        if self.tiers is None or self.version is None:
            return None
        return (self.plan.model_name, self.version, self.tiers.precomputed is not None)


class Tiers:
    """Every model's tiers in one gateway: the caches, the change feed's state, the counts.
    `version_of`: the version a call would be routed to per the spec followed (None when
    unknown: the weighted split picks, or the spec file changed and is not yet followed)."""

    def __init__(
        self,
        spec: MeshSpec,
        metrics: PredictMetrics,
        version_of: Callable[[PredictPlan], str | None],
    ) -> None:
        self.spec = spec
        self.metrics = metrics
        self.version_of = version_of
        # The cache tier of each model whose spec has one.
        self.caches: dict[str, AnswerCache] = {}
        # The store's change feed, for caches that answer without reading (feed.py);
        # followed by a task of the server's (app.py) while a model wants it.
        self.feed = FeedState()
        self.feed_wanted = asyncio.Event()
        self.clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000

    def follow_spec(self, spec: MeshSpec) -> None:
        """Drop the caches of models whose tiers went, resize the others."""
        for name, cache in list(self.caches.items()):
            model = spec.models.get(name)
            bounds = model.tiers.cache if model is not None and model.tiers else None
            if bounds is None:
                del self.caches[name]
            else:
                cache.configure(bounds.max_entries, bounds.ttl_s)
        self.spec = spec
        if self.wants_feed():
            self.feed_wanted.set()

    # --- 1. before the feature read ------------------------------------------------------

    def begin(self, plan: PredictPlan) -> TierCall:
        """The call's tiers and version; answered on the feed's word when its cache follows
        the feed and holds every row (else the mark says whether an answer may be kept)."""
        tiers = tiers_for(plan)
        call = TierCall(plan, tiers, self.version_of(plan) if tiers is not None else None)
        if call.key is None or tiers is None or not _follows_feed(tiers):
            return call
        if self.feed.fresh():
            call.answer = self._from_memory(call)
            if call.answer is None:
                call.mark = self.feed.mark()
        return call

    def read_failed(self, call: TierCall) -> None:
        """The feature read that carried the tier state failed: each tier is counted skipped
        (the call ends as the online path does, a fallback or the error)."""
        if call.key is None or call.tiers is None:
            return
        if call.tiers.precomputed is not None:
            self.metrics.record_tier(call.plan.model_name, "precomputed", SKIPPED)
        if call.tiers.cache is not None:
            self.metrics.record_tier(call.plan.model_name, "cache", SKIPPED)

    # --- 2. after the feature read, before the model -------------------------------------

    def before_online(
        self,
        call: TierCall,
        signature: ModelSignature,
        state: TierState | None,
        fresh: Mapping[str, Fresh],
        stale: str,
    ) -> gateway_pb2.PredictResponse | None:
        """The precomputed answer, else the cache's; None: the model answers (and `call`
        says where its answer is kept)."""
        tiers, version = call.tiers, call.version
        if call.key is None or tiers is None or version is None:
            return None
        if tiers.precomputed is not None:
            found = self._precomputed(call, signature, state)
            if found is not None:
                return found
        plan = call.plan
        if call.mark is not None:
            # Looked up on the feed's word already: only where to keep the answer.
            call.cache = self.caches.get(plan.model_name)
            ids = plan.reads[0].entity_ids
            call.keys = feed_keys(plan.model_name, version, ids, FEED_ONLINE)
            return None
        if tiers.cache is None or not version:
            return None
        call.cache, call.keys = self._cache_of(plan, tiers.cache, state, version, fresh, stale)
        if call.cache is None:
            return None
        rows, expired = call.cache.get_all(call.keys)
        if rows is not None:
            self.metrics.record_tier(plan.model_name, "cache", HIT)
            return response_of(rows, version, gateway_pb2.TIER_CACHE)
        self.metrics.record_tier(plan.model_name, "cache", STALE if expired else MISS)
        return None

    # --- 3. after the model ---------------------------------------------------------------

    def after_online(self, call: TierCall, answer: gateway_pb2.PredictResponse, stale: str) -> None:
        """Keep the model's answer: only the version the keys name (Envoy may have routed
        elsewhere meanwhile), never one made from stale features."""
        cache = call.cache
        if cache is None or answer.model_version != call.version or stale:
            return
        online_rows = rows_of(answer, call.plan.n_rows)
        if online_rows is not None and (call.mark is None or self._unchanged_since(call)):
            cache.put_all(call.keys, online_rows)

    # --- the change feed ------------------------------------------------------------------

    def wants_feed(self) -> bool:
        """Whether a model's cache follows the store's change feed."""
        models = self.spec.models.values()
        return any(m.tiers is not None and _follows_feed(m.tiers) for m in models)

    def feed_changed(self, changes: list[ChangeKey]) -> None:
        """Drop what the feed's changes touch from the caches that follow it."""
        self.metrics.feed_live.set(1)
        if changes:
            self.metrics.feed_changes.inc(len(changes))
        for kind, name, entity in changes:
            if kind == "model":
                cache = self.caches.get(name)
                if cache is not None:
                    cache.clear()
                continue
            for model_name, model in self.spec.models.items():
                cache = self.caches.get(model_name)
                if cache is None or model.feature_view != name:
                    continue
                if model.tiers is None or not _follows_feed(model.tiers):
                    continue
                if kind == "view":
                    cache.clear()
                    continue
                cache.drop(
                    [
                        (model_name, version, entity, held, 0)
                        for version in model.versions
                        for held in (FEED_PRECOMPUTED, FEED_ONLINE)
                    ]
                )

    def feed_broke(self) -> None:
        """The feed is lost: what the caches that follow it hold is no longer trusted."""
        self.metrics.feed_live.set(0)
        self.metrics.feed_breaks.inc()
        for model_name, model in self.spec.models.items():
            cache = self.caches.get(model_name)
            if cache is not None and model.tiers is not None and _follows_feed(model.tiers):
                cache.clear()

    # --- the tiers' lookups -----------------------------------------------------------------

    def _from_memory(self, call: TierCall) -> gateway_pb2.PredictResponse | None:
        """A tiered call answered from what this gateway holds, on the feed's word: a
        precomputed answer kept, else one made online; counted per tier."""
        plan, tiers, version = call.plan, call.tiers, call.version
        assert tiers is not None and tiers.cache is not None and version is not None
        cache = self._cache_for(plan.model_name, tiers.cache)
        ids = plan.reads[0].entity_ids
        if tiers.precomputed is not None:
            rows, _ = cache.get_all(feed_keys(plan.model_name, version, ids, FEED_PRECOMPUTED))
            if rows is not None:
                self.metrics.record_tier(plan.model_name, "precomputed", HIT)
                return response_of(rows, version, gateway_pb2.TIER_PRECOMPUTED)
        rows, expired = cache.get_all(feed_keys(plan.model_name, version, ids, FEED_ONLINE))
        if rows is not None:
            if tiers.precomputed is not None:  # looked up first, as the read way does
                self.metrics.record_tier(plan.model_name, "precomputed", MISS)
            self.metrics.record_tier(plan.model_name, "cache", HIT)
            return response_of(rows, version, gateway_pb2.TIER_CACHE)
        # A miss: the read way follows, whose precomputed lookup is counted there.
        self.metrics.record_tier(plan.model_name, "cache", STALE if expired else MISS)
        return None

    def _cache_for(self, model: str, bounds: CacheTierSpec) -> AnswerCache:
        """The model's cache, made on its first use."""
        cache = self.caches.get(model)
        if cache is None:
            cache = self.caches[model] = AnswerCache(bounds.max_entries, bounds.ttl_s)
        return cache

    def _unchanged_since(self, call: TierCall) -> bool:
        assert call.mark is not None
        read = call.plan.reads[0]
        return self.feed.unchanged_since(
            call.mark, call.plan.model_name, read.view, read.entity_ids
        )

    def _precomputed(
        self, call: TierCall, signature: ModelSignature, found: TierState | None
    ) -> gateway_pb2.PredictResponse | None:
        plan, tiers, version = call.plan, call.tiers, call.version
        assert tiers is not None and tiers.precomputed is not None and version is not None
        if found is None:
            self.metrics.record_tier(plan.model_name, "precomputed", SKIPPED)
            return None
        rows = precomputed_rows(
            found.answers,
            signature,
            found.scored_at_ms,
            self.clock_ms(),
            tiers.precomputed.max_age_ms,
        )
        if rows.rows is None:
            self.metrics.record_tier(plan.model_name, "precomputed", STALE if rows.stale else MISS)
            return None
        self.metrics.record_tier(plan.model_name, "precomputed", HIT)
        cache = self.caches.get(plan.model_name)
        if call.mark is not None and cache is not None and tiers.cache is not None:
            # Kept in memory only while its oldest row stays younger than max_age for as
            # long as the cache may hold it.
            held_ms = round(tiers.cache.ttl_s * 1000)
            young = self.clock_ms() - rows.oldest_ms + held_ms <= tiers.precomputed.max_age_ms
            if young and self._unchanged_since(call):
                ids = plan.reads[0].entity_ids
                keys = feed_keys(plan.model_name, version, ids, FEED_PRECOMPUTED)
                cache.put_all(keys, rows.rows)
        # The answers are this version's run: the read asked for it.
        return response_of(rows.rows, version, gateway_pb2.TIER_PRECOMPUTED)

    def _cache_of(
        self,
        plan: PredictPlan,
        bounds: CacheTierSpec,
        found: TierState | None,
        version: str,
        fresh: Mapping[str, Fresh],
        stale: str,
    ) -> tuple[AnswerCache | None, list[CacheKey]]:
        """The model's cache and the call's keys, or no cache: the store could not say
        whether it was flushed, or the features are stale (such answers are not kept)."""
        if found is None:
            self.metrics.record_tier(plan.model_name, "cache", SKIPPED)
            return None, []
        if stale:
            return None, []
        cache = self._cache_for(plan.model_name, bounds)
        cache.flushed(found.flush_generation)
        read = plan.reads[0]
        view_version, event_ms = fresh[read.view]
        return cache, cache_keys(plan.model_name, version, read.entity_ids, view_version, event_ms)


def _follows_feed(tiers: TiersSpec) -> bool:
    """Whether the tiers' cache answers on the change feed's word (`freshness: feed`)."""
    return tiers.cache is not None and tiers.cache.freshness == "feed"
