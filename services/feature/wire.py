"""How a GetFeatures call is written and its feature matrix read: the one place both sides
of the feature wire format meet."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from servemesh_api.feature.v1 import feature_pb2


def build_request(
    view: str, entity_ids: Sequence[str], feature_names: Sequence[str]
) -> feature_pb2.GetFeaturesRequest:
    return feature_pb2.GetFeaturesRequest(
        view=view, entity_ids=entity_ids, feature_names=feature_names
    )


def read_matrix(response: feature_pb2.GetFeaturesResponse, n_features: int) -> np.ndarray:
    """float32 (len(response.vectors), n_features)"""
    return np.array([v.values for v in response.vectors], dtype=np.float32).reshape(
        len(response.vectors), n_features
    )
