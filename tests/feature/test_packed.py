"""The packed answer (GetFeaturesRequest.packed): the same matrix and flags as the
repeated-float answer, every policy's defaults included, as one float32 buffer; without
the flag the answer is as it always was. Real service, real Redis, read through wire.py."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from servemesh.services.feature.wire import build_request, read_matrix
from servemesh.spec import FeatureViewSpec
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc
from tests.feature.conftest import DAY_MS, Staleness, StartFeatures, fresh_and_old, load_rows

FEATURES = ["a", "b", "c"]


def flags(response: feature_pb2.GetFeaturesResponse) -> list[tuple[str, bool, bool, int]]:
    return [(v.entity_id, v.defaulted, v.stale, v.event_time_unix_ms) for v in response.vectors]


async def both(
    stub: feature_pb2_grpc.FeatureServiceStub, view: str, ids: list[str], names: list[str]
) -> tuple[feature_pb2.GetFeaturesResponse, feature_pb2.GetFeaturesResponse]:
    """The same read answered plain and packed."""
    plain = await stub.GetFeatures(
        feature_pb2.GetFeaturesRequest(view=view, entity_ids=ids, feature_names=names)
    )
    packed = await stub.GetFeatures(build_request(view, ids, names))
    return plain, packed


def assert_same_answer(
    plain: feature_pb2.GetFeaturesResponse, packed: feature_pb2.GetFeaturesResponse, width: int
) -> np.ndarray:
    """The packed answer holds the plain one's values as bytes, and its vectors none."""
    assert not plain.packed_values
    assert all(not v.values for v in packed.vectors)
    assert len(packed.packed_values) == 4 * len(packed.vectors) * width
    assert flags(packed) == flags(plain)
    matrix = read_matrix(packed, width)
    assert np.array_equal(matrix, read_matrix(plain, width))
    return matrix


async def test_packed_rows_come_in_the_requested_orders_bit_exact(
    start_features: StartFeatures,
) -> None:
    running = await start_features({"p": FeatureViewSpec(features=FEATURES)})
    rows = {
        "e1": [1.5, -2.0, 3.25],
        "e2": [float(np.float32(0.1)), 1e-30, -0.0],
        "e3": [7.0, 8.0, 9.0],
    }
    await load_rows(running.stub, "p", FEATURES, rows)
    ids, names = ["e3", "e1", "e3", "e2"], ["c", "a"]
    plain, packed = await both(running.stub, "p", ids, names)
    matrix = assert_same_answer(plain, packed, len(names))
    expected = np.array([[rows[e][2], rows[e][0]] for e in ids], dtype=np.float32)
    assert matrix.tobytes() == expected.tobytes()  # -0.0 and 1e-30 as stored
    assert [v.entity_id for v in packed.vectors] == ids
    assert all(v.event_time_unix_ms > 0 and not v.defaulted for v in packed.vectors)


async def test_missing_entities_get_the_defaults_in_their_packed_rows(
    start_features: StartFeatures,
) -> None:
    view = FeatureViewSpec(features=FEATURES, defaults={"b": 7.0})
    running = await start_features({"p": view}, missing="defaults")
    await load_rows(running.stub, "p", FEATURES, {"here": [1.0, 2.0, 3.0]})
    plain, packed = await both(running.stub, "p", ["ghost", "here"], ["b", "c", "a"])
    matrix = assert_same_answer(plain, packed, 3)
    # b has a default of its own; the others take feature_store.default_value (-1 here).
    assert matrix.tolist() == [[7.0, -1.0, -1.0], [2.0, 3.0, 1.0]]
    ghost, here = packed.vectors
    assert ghost.defaulted and ghost.event_time_unix_ms == 0 and not here.defaulted


async def test_a_view_with_no_rows_yet_answers_packed_defaults(
    start_features: StartFeatures,
) -> None:
    running = await start_features({"p": FeatureViewSpec(features=FEATURES)}, missing="defaults")
    plain, packed = await both(running.stub, "p", ["x", "y"], ["a"])
    assert assert_same_answer(plain, packed, 1).tolist() == [[-1.0], [-1.0]]
    assert all(v.defaulted for v in packed.vectors)


@pytest.mark.parametrize(
    ("policy", "old_row", "old_defaulted"),
    [("default", [9.0, -1.0], True), ("degraded", [1.0, 2.0], False)],
)
async def test_stale_rows_follow_the_views_policy_in_the_packed_answer(
    start_features: StartFeatures, policy: Staleness, old_row: list[float], old_defaulted: bool
) -> None:
    stub, now, _ = await fresh_and_old(start_features, policy)
    plain, packed = await both(stub, "fresh", ["new", "old"], ["a", "b"])
    matrix = assert_same_answer(plain, packed, 2)
    assert matrix.tolist() == [[3.0, 4.0], old_row]
    new, old = packed.vectors
    assert not new.stale and old.stale and old.defaulted == old_defaulted
    assert old.event_time_unix_ms == now - 2 * DAY_MS


async def test_the_packed_flag_changes_no_refusal(start_features: StartFeatures) -> None:
    running = await start_features({"p": FeatureViewSpec(features=FEATURES)})
    await load_rows(running.stub, "p", FEATURES, {"e": [1.0, 2.0, 3.0]})
    for ids, names, code, start in (
        (["ghost"], ["a"], grpc.StatusCode.NOT_FOUND, "entity_ids"),
        (["e"], ["a", "z"], grpc.StatusCode.INVALID_ARGUMENT, "feature_names"),
        (["e", ""], ["a"], grpc.StatusCode.INVALID_ARGUMENT, "entity_ids[1]"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await running.stub.GetFeatures(build_request("p", ids, names))
        assert refused.value.code() == code
        assert refused.value.details().startswith(start)


async def test_sixteen_entities_by_sixty_four_features_packed(
    start_features: StartFeatures,
) -> None:
    running = await start_features({})
    names = [f"f{i:02d}" for i in range(64)]
    values = np.random.default_rng(5).standard_normal((40, 64)).astype(np.float32)
    rows = {f"u{i}": values[i].tolist() for i in range(40)}
    await load_rows(running.stub, "user", names, rows)
    ids = [f"u{i}" for i in range(0, 40, 5)] * 2
    plain, packed = await both(running.stub, "user", ids, names[::-1])
    matrix = assert_same_answer(plain, packed, 64)
    wanted = values[[int(e[1:]) for e in ids]][:, ::-1]
    assert np.array_equal(matrix, wanted)
    # The wire carries 4 bytes a value plus the vectors' flags, not a float list each.
    assert packed.ByteSize() < plain.ByteSize()
