"""The feature service against a real Redis, through a real gRPC server on loopback."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis

from servemesh.services.feature.app import build_server
from servemesh.services.feature.store import RedisFeatureStore
from servemesh.spec import FeatureStoreSpec, MeshSpec, resolve
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc


def _spec(redis_url: str, missing: str = "error") -> MeshSpec:
    spec = MeshSpec(
        feature_store=FeatureStoreSpec(
            redis_url=redis_url, missing_entity=missing, default_value=-1.0
        ),
        ports={"edge": 0, "mesh": 0, "envoy_admin": 0, "services_base": 0},
    )
    return resolve(spec)


@pytest.fixture
async def feature_stub(
    redis_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[feature_pb2_grpc.FeatureServiceStub]:
    missing = getattr(request, "param", "error")
    spec = _spec(redis_url, missing)
    server = await build_server(spec, "feature-zone-a-0")
    await server.start()
    async with grpc.aio.insecure_channel(spec.address_of("feature-zone-a-0")) as channel:
        yield feature_pb2_grpc.FeatureServiceStub(channel)
    await server.drain()


async def test_store_round_trips_float32_values_exactly(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    store = RedisFeatureStore(client, key_prefix=f"t{uuid.uuid4().hex[:6]}")
    values = np.random.default_rng(1).normal(size=64).astype(np.float32)
    await store.write("user", {"u1": {f"f{i}": float(v) for i, v in enumerate(values)}})
    [row] = await store.read("user", ["u1"], [f"f{i}" for i in range(64)])
    assert np.array_equal(np.asarray(row, dtype=np.float32), values)
    [missing] = await store.read("user", ["nobody"], ["f0", "f1"])
    assert missing == [None, None]
    await client.aclose()


async def test_written_features_come_back_in_requested_order(
    feature_stub: feature_pb2_grpc.FeatureServiceStub,
) -> None:
    entity = f"user-{uuid.uuid4().hex[:8]}"
    written = await feature_stub.WriteFeatures(
        feature_pb2.WriteFeaturesRequest(
            view="user",
            entities=[feature_pb2.EntityFeatures(entity_id=entity, values={"a": 1.5, "b": -2.0})],
        )
    )
    assert written.written == 1
    reply = await feature_stub.GetFeatures(
        feature_pb2.GetFeaturesRequest(
            view="user", entity_ids=[entity, entity], feature_names=["b", "a"]
        )
    )
    assert [list(v.values) for v in reply.vectors] == [[-2.0, 1.5], [-2.0, 1.5]]
    assert not reply.vectors[0].defaulted


async def test_missing_entity_is_not_found_naming_it(
    feature_stub: feature_pb2_grpc.FeatureServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await feature_stub.GetFeatures(
            feature_pb2.GetFeaturesRequest(view="user", entity_ids=["ghost-1"], feature_names=["a"])
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "ghost-1" in err.value.details() and "entity_ids" in err.value.details()


@pytest.mark.parametrize("feature_stub", ["defaults"], indirect=True)
async def test_defaults_policy_fills_missing_entities_and_flags_them(
    feature_stub: feature_pb2_grpc.FeatureServiceStub,
) -> None:
    reply = await feature_stub.GetFeatures(
        feature_pb2.GetFeaturesRequest(
            view="user", entity_ids=["ghost-2"], feature_names=["a", "b"]
        )
    )
    assert list(reply.vectors[0].values) == [-1.0, -1.0]
    assert reply.vectors[0].defaulted


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (feature_pb2.GetFeaturesRequest(view="", entity_ids=["a"], feature_names=["f"]), "view"),
        (
            feature_pb2.GetFeaturesRequest(view="user", entity_ids=[], feature_names=["f"]),
            "entity_ids",
        ),
        (
            feature_pb2.GetFeaturesRequest(view="user", entity_ids=["a", ""], feature_names=["f"]),
            "entity_ids[1]",
        ),
        (
            feature_pb2.GetFeaturesRequest(view="user", entity_ids=["a"], feature_names=[]),
            "feature_names",
        ),
        (
            feature_pb2.GetFeaturesRequest(
                view="user", entity_ids=["x" * 300], feature_names=["f"]
            ),
            "entity_ids[0]",
        ),
    ],
)
async def test_bad_reads_are_invalid_argument_naming_the_field(
    feature_stub: feature_pb2_grpc.FeatureServiceStub,
    request_: feature_pb2.GetFeaturesRequest,
    field: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await feature_stub.GetFeatures(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


async def test_non_finite_writes_are_refused_and_nothing_is_written(
    feature_stub: feature_pb2_grpc.FeatureServiceStub,
) -> None:
    entity = f"user-{uuid.uuid4().hex[:8]}"
    bad = feature_pb2.WriteFeaturesRequest(
        view="user",
        entities=[
            feature_pb2.EntityFeatures(entity_id=entity, values={"a": 1.0}),
            feature_pb2.EntityFeatures(entity_id="other", values={"a": float("nan")}),
        ],
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await feature_stub.WriteFeatures(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "entities[1].values" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await feature_stub.GetFeatures(
            feature_pb2.GetFeaturesRequest(view="user", entity_ids=[entity], feature_names=["a"])
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unreachable_redis_is_unavailable_not_a_crash() -> None:
    from servemesh.spec import free_port

    spec = _spec(f"redis://127.0.0.1:{free_port('127.0.0.1')}/0")
    server = await build_server(spec, "feature-zone-a-0")
    await server.start()
    async with grpc.aio.insecure_channel(spec.address_of("feature-zone-a-0")) as channel:
        stub = feature_pb2_grpc.FeatureServiceStub(channel)
        for _ in range(2):  # the replica keeps answering after the failure
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetFeatures(
                    feature_pb2.GetFeaturesRequest(
                        view="user", entity_ids=["a"], feature_names=["f"]
                    ),
                    timeout=5,
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await server.drain()
