"""GetFeatures with a tier ask (GetFeaturesRequest.tier) against a real Redis, through a real
gRPC server on loopback: the rows and the model version's tier state in one call, answers in
the order of the request's entities, the flush generation alone without `precomputed`, and a
bad model name refused naming `tier.model`."""

from __future__ import annotations

import json

import grpc
import pytest

from servemesh.contract.tier_keys import flush_key, scores_base
from servemesh.spec import FeatureViewSpec
from servemesh_api.feature.v1 import feature_pb2
from tests.feature.conftest import StartFeatures

TINY = {"tiny": FeatureViewSpec(features=["a", "b"], defaults={"b": 7.0})}


def ask(ids: list[str], tier: feature_pb2.TierAsk | None) -> feature_pb2.GetFeaturesRequest:
    request = feature_pb2.GetFeaturesRequest(view="tiny", entity_ids=ids, feature_names=["a"])
    if tier is not None:
        request.tier.CopyFrom(tier)
    return request


async def test_a_tier_ask_brings_the_versions_answers_and_flush_generation_with_the_rows(
    start_features: StartFeatures,
) -> None:
    running = await start_features(TINY)
    entities = [feature_pb2.EntityFeatures(entity_id=e, values={"a": 1.0, "b": 2.0}) for e in "xy"]
    await running.stub.WriteFeatures(
        feature_pb2.WriteFeaturesRequest(view="tiny", entities=entities)
    )
    base = scores_base(running.prefix, "fraud", "v2")
    answer = json.dumps({"outputs": {"score": [0.25]}, "scored_at_ms": 1000}).encode()
    await running.redis.hset(f"{base}@3", mapping={"sha256": "ab" * 32, "scored_at_ms": 1000})
    await running.redis.set(f"{base}@3:y", answer)
    await running.redis.set(f"{base}:current", 3)
    await running.redis.set(flush_key(running.prefix, "fraud"), 4)

    tier = feature_pb2.TierAsk(model="fraud", version="v2", precomputed=True)
    reply = await running.stub.GetFeatures(ask(["x", "y"], tier))
    assert [list(v.values) for v in reply.vectors] == [[1.0], [1.0]]
    assert reply.HasField("tier")
    assert (reply.tier.flush_generation, reply.tier.run) == (4, 3)
    assert (reply.tier.sha256, reply.tier.scored_at_unix_ms) == ("ab" * 32, 1000)
    assert list(reply.tier.answers) == [b"", answer]  # x has none: a miss for that call

    flush_only = await running.stub.GetFeatures(
        ask(["x", "y"], feature_pb2.TierAsk(model="fraud", version="v2"))
    )
    assert flush_only.tier.flush_generation == 4 and not flush_only.tier.answers

    plain = await running.stub.GetFeatures(ask(["x"], None))
    assert not plain.HasField("tier")


async def test_a_tier_ask_naming_no_model_is_refused_naming_the_field(
    start_features: StartFeatures,
) -> None:
    running = await start_features(TINY)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await running.stub.GetFeatures(
            ask(["x"], feature_pb2.TierAsk(model="Fraud!", version="v1", precomputed=True))
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("tier.model: ")
