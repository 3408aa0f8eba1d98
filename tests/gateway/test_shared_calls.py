"""Pure pieces of the gateway's shared calls: one answer cut back into each Predict's, and
the headers by which a shared call is checked against where Envoy sent it."""

from __future__ import annotations

import numpy as np
import pytest

from servemesh.contract.wire import BUCKET_RANGE_HEADER, SHADOW_ROLE_HEADER
from servemesh.services.gateway.predict import split_outputs
from servemesh.services.gateway.service import (
    _breaker_counts_calls,
    _served_range,
    _shadowed,
)
from servemesh.services.runtime.errors import Internal
from servemesh.spec.policy import CircuitBreakers
from servemesh_api.inference import grpc_service_pb2 as oip


def _answer(rows: int) -> oip.ModelInferResponse:
    reply = oip.ModelInferResponse(model_name="m", model_version="v1")
    reply.outputs.add(name="score", datatype="FP32", shape=[rows, 1])
    reply.raw_output_contents.append(np.arange(rows, dtype="<f4").tobytes())
    return reply


def test_a_shared_answer_is_cut_into_each_member_s_rows_in_order() -> None:
    cut = split_outputs(_answer(6), [1, 3, 2])
    assert [list(c["score"].shape) for c in cut] == [[1, 1], [3, 1], [2, 1]]
    assert [list(c["score"].float_values) for c in cut] == [[0.0], [1.0, 2.0, 3.0], [4.0, 5.0]]


def test_an_answer_short_of_the_members_rows_is_internal() -> None:
    with pytest.raises(Internal, match="for 7 rows"):
        split_outputs(_answer(6), [4, 3])


def test_the_answering_route_s_range_and_mirror_are_read_from_its_headers() -> None:
    assert _served_range([(BUCKET_RANGE_HEADER, "2500-7500")]) == (2500, 7500)
    assert _served_range([("other", "1")]) is None
    assert _served_range([(BUCKET_RANGE_HEADER, "garbage")]) is None
    assert _shadowed([(SHADOW_ROLE_HEADER, "primary")])
    assert not _shadowed([(SHADOW_ROLE_HEADER, "shadow"), ("x", "y")])


def test_a_breaker_sized_below_a_shared_call_keeps_its_route_per_predict() -> None:
    assert not _breaker_counts_calls(CircuitBreakers(), 64)
    assert _breaker_counts_calls(CircuitBreakers(max_requests=2, max_pending_requests=1), 64)
    assert _breaker_counts_calls(CircuitBreakers(max_pending_requests=10), 64)
