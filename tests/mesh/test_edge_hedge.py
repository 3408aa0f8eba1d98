"""Hedged calls at the edge (`traffic.edge_hedge`), on a real Envoy in front of stand-ins.

Every stand-in gateway holds the first try of each call for longer than the caller's
deadline and answers any later try of it at once: the gateway a call reached first is
starved, the other is not. With hedging on, the edge asks a second gateway once the first
has held a Predict or a ModelInfer `after_ms` (a REST Predict too, once transcoded), and
the caller is answered; a method that is not an idempotent read is never sent twice, so it
runs out its deadline on the slow one.
"""

from __future__ import annotations

import ssl
from collections import Counter

import grpc
import httpx
import pytest

from servemesh.contract.wire import OIP_SERVICE, REQUEST_ID_HEADER, method_path
from servemesh.identity import mesh_identity
from servemesh.spec.policy import EdgeHedge, TrafficSpec
from tests.mesh.test_edge_hardening import (
    HOLD_FIRST_TRY,
    MODEL_INFER,
    PREDICT,
    Front,
    FrontFactory,
    _call,
    _wait_every_upstream_healthy,
)
from tests.mesh.test_edge_hardening import front_factory as front_factory  # the fixture

pytestmark = pytest.mark.mesh

HELD_MS = "20000"  # far past every deadline below
DEADLINE_S = 5.0
CALLS = 12


@pytest.fixture(scope="module")
def hedging(front_factory: FrontFactory) -> Front:
    started = front_factory(TrafficSpec(edge_hedge=EdgeHedge(after_ms=200)))
    _wait_every_upstream_healthy(started)
    return started


def _tries_per_call(front: Front, method: str, before: int) -> list[int]:
    """How many tries of each call after the first `before` calls reached a gateway."""
    seen = front.recorder.seen(method)[before:]
    return list(Counter(call.metadata[REQUEST_ID_HEADER] for call in seen).values())


@pytest.mark.parametrize("method", [PREDICT, MODEL_INFER])
def test_a_read_a_starved_gateway_holds_is_answered_by_another(hedging: Front, method: str) -> None:
    before = len(hedging.recorder.seen(method))
    codes = [
        _call(hedging.edge, method, ((HOLD_FIRST_TRY, HELD_MS),), timeout_s=DEADLINE_S)
        for _ in range(CALLS)
    ]
    assert codes == [grpc.StatusCode.OK] * CALLS
    # Each answer came from a hedge: the first try was still held when it was sent.
    assert _tries_per_call(hedging, method, before) == [2] * CALLS


def test_a_method_that_is_not_a_read_is_never_sent_twice(hedging: Front) -> None:
    method = method_path(OIP_SERVICE, "RepositoryIndex")
    before = len(hedging.recorder.seen(method))
    code = _call(hedging.edge, method, ((HOLD_FIRST_TRY, HELD_MS),), timeout_s=1.0)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _tries_per_call(hedging, method, before) == [1]


def test_a_rest_predict_is_hedged_once_transcoded(hedging: Front) -> None:
    # REST calls are matched again once transcoded to gRPC: the Predict route hedges them.
    trust = ssl.create_default_context(cafile=str(mesh_identity(hedging.spec).trust_file))
    before = len(hedging.recorder.seen(PREDICT))
    url = f"https://{hedging.spec.edge_address}"
    with httpx.Client(base_url=url, verify=trust, timeout=DEADLINE_S) as rest:
        answered = rest.post(
            "/v1/models/fraud:predict",
            json={"entity_ids": ["user-1"]},
            headers={HOLD_FIRST_TRY: HELD_MS},
        )
    assert answered.status_code == 200, answered.text
    assert _tries_per_call(hedging, PREDICT, before) == [2]
