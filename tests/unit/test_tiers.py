"""The gateway's tiers without a network: which calls may use them, the version a call is
routed to, the cache (LRU, TTL, flushes) and its keys, answers made from a tier's rows."""

from __future__ import annotations

import json

import pytest

from servemesh.contract.wire import bucket_ranges
from servemesh.services.gateway.predict import ModelSignature, TensorMeta, plan_predict
from servemesh.services.gateway.tiers import (
    AnswerCache,
    cache_keys,
    precomputed_rows,
    response_of,
    routed_version,
    rows_of,
    tiers_for,
)
from servemesh.spec import MeshSpec, SpecError, parse_spec
from servemesh_api.gateway.v1 import gateway_pb2

TIERED = (
    "models:\n  fraud:\n    traffic: {v1: 50, v2: 50}\n"
    "    tiers:\n      cache: {ttl: 10s, max_entries: 2}\n"
)
SIGNATURE = ModelSignature(
    inputs=(TensorMeta("features", "FP32", (-1, 64)),),
    outputs=(TensorMeta("score", "FP32", (-1, 1)),),
)


def spec() -> MeshSpec:
    return parse_spec(TIERED)


def test_tiers_are_off_by_default_and_strict() -> None:
    assert MeshSpec().models["fraud"].tiers is None
    with pytest.raises(SpecError):
        parse_spec("models:\n  fraud:\n    tiers: {cache: {ttl: 10m, size: 3}}\n")


def test_only_entity_calls_of_a_tiered_model_use_tiers() -> None:
    s = spec()
    entities = plan_predict(gateway_pb2.PredictRequest(model="fraud", entity_ids=["u1"]), s)
    assert tiers_for(entities) is not None
    rows = gateway_pb2.PredictRequest(
        model="fraud", rows=[gateway_pb2.FeatureRow(values=[0.0] * 64)]
    )
    assert tiers_for(plan_predict(rows, s)) is None
    untiered = plan_predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=["u1"]), MeshSpec()
    )
    assert tiers_for(untiered) is None


def test_the_routed_version_is_the_sticky_buckets_or_the_pinned_one() -> None:
    s = spec()
    ranges = bucket_ranges(s.models["fraud"].traffic)
    seen = set()
    for i in range(200):
        plan = plan_predict(gateway_pb2.PredictRequest(model="fraud", entity_ids=[f"u{i}"]), s)
        version = routed_version(plan, ranges)
        start, end = ranges[version or ""]
        assert plan.bucket is not None and start <= plan.bucket < end
        seen.add(version)
    assert seen == {"v1", "v2"}
    pinned = plan_predict(
        gateway_pb2.PredictRequest(model="fraud", version="v2", entity_ids=["u1"]), s
    )
    assert routed_version(pinned, ranges) == "v2"
    # Weights moved: the same entity may route elsewhere, never to a version at 0%.
    moved = bucket_ranges({"v1": 0, "v2": 100})
    plan = plan_predict(gateway_pb2.PredictRequest(model="fraud", entity_ids=["u1"]), s)
    assert routed_version(plan, moved) == "v2"


def test_a_changed_feature_row_or_version_makes_another_key() -> None:
    [key] = cache_keys("fraud", "v1", ["u1"], 3, [1000])
    assert cache_keys("fraud", "v1", ["u1"], 4, [1000]) != [key]  # a load: new view version
    assert cache_keys("fraud", "v1", ["u1"], 3, [2000]) != [key]  # a write: new event time
    assert cache_keys("fraud", "v2", ["u1"], 3, [1000]) != [key]  # another version


def _row(score: float) -> dict[str, tuple[str, tuple[int, ...], tuple[float, ...]]]:
    return {"score": ("FP32", (1,), (score,))}


def test_the_cache_is_lru_bounded_and_expires_by_ttl() -> None:
    now = [0.0]
    cache = AnswerCache(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    a, b, c = (cache_keys("fraud", "v1", [e], 1, [1])[0] for e in "abc")
    cache.put_all([a, b], [_row(0.1), _row(0.2)])
    assert cache.get_all([a])[0] == [_row(0.1)]  # a is now the most recently used
    cache.put_all([c], [_row(0.3)])  # b, the least recently used, goes
    assert cache.get_all([b]) == (None, False)
    assert len(cache) == 2
    now[0] = 9.9
    assert cache.get_all([a, c])[0] == [_row(0.1), _row(0.3)]
    now[0] = 10.0
    assert cache.get_all([a]) == (None, True)  # expired: a stale reject
    assert len(cache) == 1


def test_a_new_flush_generation_empties_the_cache() -> None:
    cache = AnswerCache(max_entries=10, ttl_s=60.0)
    key = cache_keys("fraud", "v1", ["a"], 1, [1])
    assert not cache.flushed(0)  # the first generation seen drops nothing
    cache.put_all(key, [_row(0.5)])
    assert not cache.flushed(0)
    assert cache.get_all(key)[0] is not None
    assert cache.flushed(1)
    assert cache.get_all(key) == (None, False)


def test_rows_of_an_answer_come_back_as_the_same_answer() -> None:
    online = gateway_pb2.PredictResponse(
        outputs={
            "score": gateway_pb2.Tensor(datatype="FP32", shape=[2, 1], float_values=[0.25, 0.75])
        },
        scores=[0.25, 0.75],
        model_version="v1",
    )
    rows = rows_of(online, 2)
    assert rows is not None
    again = response_of(rows, "v1", gateway_pb2.TIER_CACHE)
    assert list(again.scores) == [0.25, 0.75]
    assert again.outputs["score"] == online.outputs["score"]
    assert again.tier == gateway_pb2.TIER_CACHE


def _stored(score: float, at: int) -> bytes:
    return json.dumps({"outputs": {"score": [score]}, "scored_at_ms": at}).encode()


def test_precomputed_answers_are_typed_by_the_signature_and_refused_when_old() -> None:
    day = 86_400_000
    found = precomputed_rows([_stored(0.5, day)], SIGNATURE, day, day + 1000, max_age_ms=day)
    assert found.rows == [{"score": ("FP32", (1,), (0.5,))}]
    old = precomputed_rows([_stored(0.5, day)], SIGNATURE, day, 2 * day + 1, max_age_ms=day)
    assert old.rows is None and old.stale
    missing = precomputed_rows([_stored(0.5, day), b""], SIGNATURE, day, day, max_age_ms=day)
    assert missing.rows is None and not missing.stale
    other = json.dumps({"outputs": {"logits": [1.0]}, "scored_at_ms": day}).encode()
    assert precomputed_rows([other], SIGNATURE, day, day, max_age_ms=day).rows is None
