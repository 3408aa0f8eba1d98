"""Reads honour each view's max_age: each staleness policy proven with a row whose event
time is older than max_age beside a fresh one, and the stale-read counter."""

from __future__ import annotations

import grpc
import pytest

from servemesh.observe.scrape import sample, scrape
from servemesh_api.feature.v1 import feature_pb2
from tests.feature.conftest import DAY_MS, StartFeatures, fresh_and_old

READ = feature_pb2.GetFeaturesRequest(
    view="fresh", entity_ids=["new", "old"], feature_names=["b", "a"]
)


def stale_reads(metrics: str, policy: str) -> float:
    """The stale-read counter of the view, as the service's /metrics at `metrics` says."""
    labels = {"view": "fresh", "policy": policy}
    return sample(scrape(metrics), "servemesh_feature_stale_reads_total", labels)


async def test_error_policy_refuses_a_stale_entity_naming_it_and_its_age(
    start_features: StartFeatures,
) -> None:
    stub, _, metrics = await fresh_and_old(start_features, "error")
    before = stale_reads(metrics, "error")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetFeatures(READ)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details()
    assert details == "entity_ids: stale in feature view 'fresh' (max_age 1h): old is 2d 0h old"
    assert stale_reads(metrics, "error") == before + 1
    # The fresh entity alone reads fine, and is not counted.
    fresh = feature_pb2.GetFeaturesRequest(view="fresh", entity_ids=["new"], feature_names=["a"])
    [vector] = (await stub.GetFeatures(fresh)).vectors
    assert list(vector.values) == [3.0] and not vector.stale
    assert stale_reads(metrics, "error") == before + 1


async def test_default_policy_answers_the_views_defaults_flagged(
    start_features: StartFeatures,
) -> None:
    stub, now, metrics = await fresh_and_old(start_features, "default")
    before = stale_reads(metrics, "default")
    new, old = (await stub.GetFeatures(READ)).vectors
    assert list(new.values) == [4.0, 3.0] and not new.defaulted and not new.stale
    # b has no default of its own: feature_store.default_value (-1 in these tests).
    assert list(old.values) == [-1.0, 9.0] and old.defaulted and old.stale
    assert old.event_time_unix_ms == now - 2 * DAY_MS
    assert stale_reads(metrics, "default") == before + 1


async def test_degraded_policy_answers_the_stored_values_flagged_stale(
    start_features: StartFeatures,
) -> None:
    stub, _, metrics = await fresh_and_old(start_features, "degraded")
    before = stale_reads(metrics, "degraded")
    new, old = (await stub.GetFeatures(READ)).vectors
    assert list(new.values) == [4.0, 3.0] and not new.stale
    assert list(old.values) == [2.0, 1.0] and old.stale and not old.defaulted
    await stub.GetFeatures(READ)
    assert stale_reads(metrics, "degraded") == before + 2


async def test_without_max_age_rows_never_go_stale(start_features: StartFeatures) -> None:
    stub, _, metrics = await fresh_and_old(start_features, "error", max_age=None)
    before = stale_reads(metrics, "error")
    vectors = (await stub.GetFeatures(READ)).vectors
    assert [list(v.values) for v in vectors] == [[4.0, 3.0], [2.0, 1.0]]
    assert not any(v.stale for v in vectors)
    assert stale_reads(metrics, "error") == before
