"""Bounded inputs of the feature service: per-call caps from the spec's limits, names
checked whole, caller strings cut short in errors, and Redis failures as plain statuses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from servemesh.procs import RedisServer, Supervisor
from servemesh.spec import FeatureViewSpec, Limits
from servemesh_api.feature.v1 import feature_pb2
from tests.feature.conftest import StartFeatures, load_rows

FEATURES = [f"f{i}" for i in range(8)]
WIDE = {"wide": FeatureViewSpec(features=FEATURES)}


async def _refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


async def test_too_many_feature_names_are_refused_naming_the_field_and_the_cap(
    start_features: StartFeatures,
) -> None:
    running = await start_features(WIDE, limits=Limits(max_feature_names=4))
    request = feature_pb2.GetFeaturesRequest(
        view="wide", entity_ids=["e-1"], feature_names=FEATURES[:5]
    )
    error = await _refused(running.stub.GetFeatures(request, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "feature_names: 5 names, at most 4 per call (limits.max_feature_names)"
    )
    # At the cap it is served (the entity is simply missing: NOT_FOUND, not a refusal).
    at_cap = feature_pb2.GetFeaturesRequest(
        view="wide", entity_ids=["e-1"], feature_names=FEATURES[:4]
    )
    error = await _refused(running.stub.GetFeatures(at_cap, timeout=10))
    assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_entities_times_features_over_the_cap_is_refused(
    start_features: StartFeatures,
) -> None:
    running = await start_features(WIDE, limits=Limits(max_feature_cells=20))
    await load_rows(running.stub, "wide", FEATURES, {f"e-{i}": [1.0] * 8 for i in range(3)})
    ok = feature_pb2.GetFeaturesRequest(
        view="wide", entity_ids=["e-0", "e-1"], feature_names=FEATURES
    )
    assert len((await running.stub.GetFeatures(ok, timeout=10)).vectors) == 2  # 16 values
    over = feature_pb2.GetFeaturesRequest(
        view="wide", entity_ids=["e-0", "e-1", "e-2"], feature_names=FEATURES
    )
    error = await _refused(running.stub.GetFeatures(over, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("feature_names: 3 entities x 8 features = 24 values")
    assert "at most 20 per call (limits.max_feature_cells)" in error.details()


async def test_a_load_naming_too_many_features_is_refused(start_features: StartFeatures) -> None:
    running = await start_features(
        {"open": FeatureViewSpec(features=None)}, limits=Limits(max_feature_names=4)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await load_rows(running.stub, "open", FEATURES, {"e-1": [1.0] * 8})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("header.feature_names: 8 names, at most 4")


async def test_a_view_name_is_checked_whole_a_trailing_newline_is_not_a_name(
    start_features: StartFeatures,
) -> None:
    running = await start_features({})
    request = feature_pb2.GetFeaturesRequest(
        view="user\n", entity_ids=["user-1"], feature_names=["f00"]
    )
    error = await _refused(running.stub.GetFeatures(request, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("view: 'user\\n' is not a view name")


async def test_caller_strings_come_back_cut_short(start_features: StartFeatures) -> None:
    running = await start_features({})
    huge = "v" * 100_000
    request = feature_pb2.GetFeaturesRequest(view=huge, entity_ids=["e"], feature_names=["f00"])
    error = await _refused(running.stub.GetFeatures(request, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(error.details()) < 200 and "v" * 64 + "...'" in error.details()
    # Missing entities are listed, each cut short, ten at most.
    ids = [f"{i:03d}" + "x" * 250 for i in range(50)]
    missing = feature_pb2.GetFeaturesRequest(view="user", entity_ids=ids, feature_names=["f00"])
    error = await _refused(running.stub.GetFeatures(missing, timeout=10))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert len(error.details()) < 1200 and "and 40 more" in error.details()


async def test_a_redis_error_reply_is_internal_without_its_text(
    start_features: StartFeatures,
) -> None:
    running = await start_features({})
    # The view's version pointer made a hash: Redis answers WRONGTYPE to the read.
    await running.redis.hset(f"{running.prefix}:user:current", "x", "1")
    request = feature_pb2.GetFeaturesRequest(
        view="user", entity_ids=["user-1"], feature_names=["f00"]
    )
    error = await _refused(running.stub.GetFeatures(request, timeout=10))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "feature store error"


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with Supervisor(tmp_path / "logs") as supervisor:
        server = RedisServer(supervisor, tmp_path / "redis")
        server.start(timeout_s=15)
        yield server


async def test_a_refused_password_is_unavailable_and_never_echoed(
    start_features: StartFeatures, own_redis: RedisServer, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    running = await start_features({}, redis_url=own_redis.url, password_file=wrong)
    request = feature_pb2.GetFeaturesRequest(
        view="user", entity_ids=["user-1"], feature_names=["f00"]
    )
    error = await _refused(running.stub.GetFeatures(request, timeout=10))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "feature store unavailable"
