"""How a caller asks the feature service for a matrix and reads it back: the one place that
knows the packed answer's layout (GetFeaturesResponse.packed_values: float32, little-endian,
row-major, one row per vector).

    request = build_request(view, entity_ids, feature_names)   # asks for the packed answer
    matrix = read_matrix(await stub.GetFeatures(request), len(feature_names))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from servemesh.contract.errors import ServemeshError
from servemesh_api.feature.v1 import feature_pb2

# The packed answer's cell: float32, little-endian, whatever this machine's byte order.
CELL = np.dtype("<f4")


class MalformedAnswer(ServemeshError, ValueError):
    """A GetFeatures answer whose values do not make the matrix asked for."""


def build_request(
    view: str,
    entity_ids: Sequence[str],
    feature_names: Sequence[str],
    tier: tuple[str, str, bool] | None = None,
) -> feature_pb2.GetFeaturesRequest:
    """A GetFeatures request for `entity_ids` x `feature_names` of `view`, answered packed;
    with `tier` (model, version, precomputed), that model version's tier state beside it."""
    request = feature_pb2.GetFeaturesRequest(
        view=view, entity_ids=entity_ids, feature_names=feature_names, packed=True
    )
    if tier is not None:
        request.tier.model, request.tier.version, request.tier.precomputed = tier
    return request


def read_matrix(response: feature_pb2.GetFeaturesResponse, n_features: int) -> np.ndarray:
    """float32 (len(response.vectors), n_features): the packed bytes when the answer has
    them (a read-only view of them, no copy), else each vector's `values`.

    MalformedAnswer when the answer does not hold exactly that many values.
    """
    rows = len(response.vectors)
    packed = response.packed_values
    if packed:
        expected = rows * n_features * CELL.itemsize
        if len(packed) != expected:
            raise MalformedAnswer(
                f"packed_values: {len(packed)} bytes; {rows} vectors of {n_features} float32 "
                f"values take {expected}"
            )
        return np.frombuffer(packed, dtype=CELL).reshape(rows, n_features)
    for i, vector in enumerate(response.vectors):
        if len(vector.values) != n_features:
            raise MalformedAnswer(
                f"vectors[{i}].values: {len(vector.values)} values, {n_features} expected"
            )
    matrix = np.array([v.values for v in response.vectors], dtype=np.float32)
    return matrix.reshape(rows, n_features)
