"""The feature service against a real Redis, through a real gRPC server on loopback."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis

from servemesh.services.feature.app import build_server
from servemesh.services.feature.store import RedisFeatureStore
from servemesh.spec import FeatureViewSpec, free_port
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc
from tests.feature.conftest import INSTANCE, StartFeatures, features_spec

TINY = {"tiny": FeatureViewSpec(features=["a", "b"], defaults={"b": 7.0})}


async def test_store_round_trips_float32_values_exactly(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    store = RedisFeatureStore(client, key_prefix=f"t{uuid.uuid4().hex[:6]}")
    values = np.random.default_rng(1).normal(size=(1, 64)).astype(np.float32)
    load = await store.begin_load("user", [f"f{i}" for i in range(64)], "test")
    await load.add(["u1"], values, np.array([1234], dtype=np.int64))
    await load.commit()
    version, rows = await store.read("user", ["u1", "nobody"])
    assert version is not None and rows is not None
    assert np.array_equal(rows.values[0], values[0])
    assert rows.event_ms[0] == 1234
    assert rows.present.tolist() == [True, False]
    await client.aclose()


async def test_written_features_come_back_in_requested_order(start_features: StartFeatures) -> None:
    stub = (await start_features(TINY)).stub
    entity = f"user-{uuid.uuid4().hex[:8]}"
    written = await stub.WriteFeatures(
        feature_pb2.WriteFeaturesRequest(
            view="tiny",
            entities=[feature_pb2.EntityFeatures(entity_id=entity, values={"a": 1.5, "b": -2.0})],
        )
    )
    assert written.written == 1
    reply = await stub.GetFeatures(
        feature_pb2.GetFeaturesRequest(
            view="tiny", entity_ids=[entity, entity], feature_names=["b", "a"]
        )
    )
    assert [list(v.values) for v in reply.vectors] == [[-2.0, 1.5], [-2.0, 1.5]]
    assert not reply.vectors[0].defaulted and not reply.vectors[0].stale
    assert reply.vectors[0].event_time_unix_ms > 0


async def test_a_write_overwrites_the_current_version_in_place(
    start_features: StartFeatures,
) -> None:
    running = await start_features(TINY)

    def write(entity: str, a: float) -> feature_pb2.WriteFeaturesRequest:
        values = {"a": a, "b": 0.0}
        entities = [feature_pb2.EntityFeatures(entity_id=entity, values=values)]
        return feature_pb2.WriteFeaturesRequest(view="tiny", entities=entities)

    await running.stub.WriteFeatures(write("e1", 1.0))
    await running.stub.WriteFeatures(write("e2", 2.0))
    await running.stub.WriteFeatures(write("e1", 3.0))
    reply = await running.stub.GetFeatures(
        feature_pb2.GetFeaturesRequest(view="tiny", entity_ids=["e1", "e2"], feature_names=["a"])
    )
    assert [list(v.values) for v in reply.vectors] == [[3.0], [2.0]]
    prefix = running.prefix
    assert {k for k in await running.keys() if ":e" in k} == {
        f"{prefix}:tiny@1:e1",
        f"{prefix}:tiny@1:e2",
    }


async def test_missing_entity_is_not_found_naming_it(start_features: StartFeatures) -> None:
    stub = (await start_features(TINY)).stub
    # A view without rows yet, and one with a version (the first write makes it).
    for view, feature in (("user", "f00"), ("tiny", "a")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetFeatures(
                feature_pb2.GetFeaturesRequest(
                    view=view, entity_ids=["ghost-1"], feature_names=[feature]
                )
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "ghost-1" in err.value.details() and "entity_ids" in err.value.details()
        values = {"a": 1.0, "b": 2.0}
        await stub.WriteFeatures(
            feature_pb2.WriteFeaturesRequest(
                view="tiny", entities=[feature_pb2.EntityFeatures(entity_id="e", values=values)]
            )
        )


async def test_defaults_policy_fills_missing_entities_with_the_views_defaults_and_flags_them(
    start_features: StartFeatures,
) -> None:
    stub = (await start_features(TINY, missing="defaults")).stub
    reply = await stub.GetFeatures(
        feature_pb2.GetFeaturesRequest(
            view="tiny", entity_ids=["ghost-2"], feature_names=["a", "b"]
        )
    )
    # b has a default of its own in the view; a takes feature_store.default_value.
    assert list(reply.vectors[0].values) == [-1.0, 7.0]
    assert reply.vectors[0].defaulted and not reply.vectors[0].stale


async def test_unknown_views_and_features_are_refused_naming_them(
    start_features: StartFeatures,
) -> None:
    stub = (await start_features(TINY)).stub
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetFeatures(
            feature_pb2.GetFeaturesRequest(view="nope", entity_ids=["e"], feature_names=["a"])
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details().startswith("view: 'nope'") and "tiny" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetFeatures(
            feature_pb2.GetFeaturesRequest(view="tiny", entity_ids=["e"], feature_names=["a", "z"])
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("feature_names:") and "z" in err.value.details()


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
    start_features: StartFeatures,
    request_: feature_pb2.GetFeaturesRequest,
    field: str,
) -> None:
    stub = (await start_features({})).stub
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetFeatures(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


async def test_non_finite_writes_are_refused_and_nothing_is_written(
    start_features: StartFeatures,
) -> None:
    running = await start_features(TINY)
    entity = f"user-{uuid.uuid4().hex[:8]}"
    bad = feature_pb2.WriteFeaturesRequest(
        view="tiny",
        entities=[
            feature_pb2.EntityFeatures(entity_id=entity, values={"a": 1.0, "b": 1.0}),
            feature_pb2.EntityFeatures(entity_id="other", values={"a": float("nan"), "b": 1.0}),
        ],
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.WriteFeatures(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("entities[1].values['a']")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.GetFeatures(
            feature_pb2.GetFeaturesRequest(view="tiny", entity_ids=[entity], feature_names=["a"])
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert await running.keys() == set()


async def test_a_write_gives_every_feature_of_the_view(start_features: StartFeatures) -> None:
    stub = (await start_features(TINY)).stub
    partial = feature_pb2.WriteFeaturesRequest(
        view="tiny", entities=[feature_pb2.EntityFeatures(entity_id="e", values={"a": 1.0})]
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.WriteFeatures(partial)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("entities[0].values") and "b" in err.value.details()


async def test_unreachable_redis_is_unavailable_not_a_crash(tmp_path: Path) -> None:
    spec = features_spec(f"redis://127.0.0.1:{free_port('127.0.0.1')}/0", tmp_path, {})
    server = await build_server(spec, INSTANCE, tls=False)
    await server.start()
    async with grpc.aio.insecure_channel(spec.address_of(INSTANCE)) as channel:
        stub = feature_pb2_grpc.FeatureServiceStub(channel)
        for _ in range(2):  # the replica keeps answering after the failure
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetFeatures(
                    feature_pb2.GetFeaturesRequest(
                        view="user", entity_ids=["a"], feature_names=["f00"]
                    ),
                    timeout=5,
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await server.drain()
