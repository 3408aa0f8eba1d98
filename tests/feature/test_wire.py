"""wire.py, the gateway's one way to ask for and read a feature matrix: the packed answer's
bytes decoded exactly, the repeated-float answer still read, a malformed answer refused."""

from __future__ import annotations

import numpy as np
import pytest

from servemesh.services.feature.wire import MalformedAnswer, build_request, read_matrix
from servemesh_api.feature.v1 import feature_pb2


def packed_answer(matrix: np.ndarray, ids: list[str]) -> feature_pb2.GetFeaturesResponse:
    response = feature_pb2.GetFeaturesResponse(packed_values=matrix.astype("<f4").tobytes())
    for entity_id in ids:
        response.vectors.add(entity_id=entity_id, event_time_unix_ms=1)
    return response


def test_build_request_asks_for_the_packed_answer() -> None:
    request = build_request("user", ["u1", "u2"], ["f01", "f00"])
    assert request.packed
    assert request.view == "user"
    assert list(request.entity_ids) == ["u1", "u2"]
    assert list(request.feature_names) == ["f01", "f00"]


def test_read_matrix_decodes_the_packed_bytes_row_major_and_exactly() -> None:
    # Values float32 cannot round from a float64 text form: the bytes go through as they are.
    matrix = np.random.default_rng(3).standard_normal((3, 5)).astype(np.float32)
    matrix[1, 2] = np.float32(1e-45)  # a denormal
    read = read_matrix(packed_answer(matrix, ["a", "b", "c"]), 5)
    assert read.dtype == np.float32 and read.shape == (3, 5)
    assert np.array_equal(read, matrix)
    assert read.tobytes() == matrix.tobytes()


def test_read_matrix_reads_the_repeated_values_of_an_answer_without_bytes() -> None:
    response = feature_pb2.GetFeaturesResponse()
    response.vectors.add(entity_id="a", values=[1.0, 2.0])
    response.vectors.add(entity_id="b", values=[3.0, 4.5])
    read = read_matrix(response, 2)
    assert read.dtype == np.float32
    assert read.tolist() == [[1.0, 2.0], [3.0, 4.5]]


def test_an_answer_with_no_vectors_is_an_empty_matrix_of_the_asked_width() -> None:
    assert read_matrix(feature_pb2.GetFeaturesResponse(), 4).shape == (0, 4)


@pytest.mark.parametrize("cut", [-4, -1, 3, 8])
def test_packed_bytes_of_the_wrong_length_are_refused_naming_both_lengths(cut: int) -> None:
    good = packed_answer(np.ones((2, 3), np.float32), ["a", "b"])
    raw = good.packed_values
    bad = feature_pb2.GetFeaturesResponse(
        vectors=good.vectors, packed_values=raw[:cut] if cut < 0 else raw + b"\0" * cut
    )
    with pytest.raises(MalformedAnswer) as refused:
        read_matrix(bad, 3)
    assert f"packed_values: {len(raw) + cut} bytes" in str(refused.value)
    assert "2 vectors of 3 float32 values take 24" in str(refused.value)


def test_packed_bytes_for_another_width_are_refused() -> None:
    # 2 x 3 values read as rows of 2: the byte count does not fit 2 vectors of 2.
    answer = packed_answer(np.ones((2, 3), np.float32), ["a", "b"])
    with pytest.raises(MalformedAnswer):
        read_matrix(answer, 2)


def test_repeated_values_of_the_wrong_count_are_refused_naming_the_vector() -> None:
    response = feature_pb2.GetFeaturesResponse()
    response.vectors.add(entity_id="a", values=[1.0, 2.0])
    response.vectors.add(entity_id="b", values=[3.0])
    with pytest.raises(MalformedAnswer, match=r"vectors\[1\]\.values: 1 values, 2 expected"):
        read_matrix(response, 2)
