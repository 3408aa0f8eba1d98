"""What counts as a finding, and that the generators yield messages of each method's type."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servemesh.contract.wire import CONTROL_METHODS
from servemesh.fuzz.campaign import UNDECODABLE, Outcome, judge
from servemesh.fuzz.rpcs import RPCS, Rpc
from servemesh.fuzz.strategies import Known, near_valid, raw, structured

KNOWN = Known(
    models={"fraud": ["v1", "v2"]},
    views={"user": [f"f{i:02d}" for i in range(64)]},
    entities=["user-1", "user-2"],
    inputs={"features": "FP32"},
)


@pytest.mark.parametrize(
    ("code", "details", "elapsed", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 'inputs["x"].shape: must be 2-D', 0.01, None),
        (grpc.StatusCode.NOT_FOUND, "model 'nope' is not served", 0.01, None),
        (grpc.StatusCode.INTERNAL, UNDECODABLE, 0.01, None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 5.5, None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 30.0, "hang"),
        (grpc.StatusCode.UNKNOWN, "Unexpected <class 'KeyError'>: 'x'", 0.01, "unknown"),
        (grpc.StatusCode.INVALID_ARGUMENT, "ValueError: could not convert", 0.01, "leak"),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            'Traceback (most recent call last):\n  File "',
            0,
            "leak",
        ),
        (grpc.StatusCode.NOT_FOUND, "<servemesh.Thing object at 0x7f00>", 0.01, "leak"),
        (grpc.StatusCode.UNAVAILABLE, "upstream connect error or disconnect/reset", 0.1, "reset"),
        (grpc.StatusCode.UNAVAILABLE, "no healthy upstream", 0.01, None),
        (grpc.StatusCode.INTERNAL, "internal error", 0.01, "internal"),
    ],
)
def test_a_finding_is_a_hang_an_unknown_a_reset_an_internal_or_a_leak(
    code: grpc.StatusCode, details: str, elapsed: float, kind: str | None
) -> None:
    assert judge(Outcome(code, details, elapsed), timeout_s=5.0) == kind


def test_a_name_the_caller_sent_echoed_back_is_no_leak() -> None:
    details = "model: 'RequestError' is not a valid name"
    outcome = Outcome(grpc.StatusCode.INVALID_ARGUMENT, details, 0.01)
    assert judge(outcome, 5.0, sent=b"\x0a\x0cRequestError") is None
    assert judge(outcome, 5.0, sent=b"\x0a\x03abc") == "leak"


def test_every_public_rpc_is_fuzzed_and_every_control_method_among_them() -> None:
    paths = {rpc.path for rpc in RPCS}
    assert CONTROL_METHODS <= paths
    assert {rpc.api for rpc in RPCS} == {"gateway", "model", "feature", "registry"}
    assert len(paths) == len(RPCS) == 21


@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.name)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_structured_requests_parse_as_the_methods_request_type(
    rpc: Rpc, data: st.DataObject
) -> None:
    strategy = data.draw(st.sampled_from([structured, near_valid]))
    bodies = data.draw(strategy(rpc, KNOWN))
    if rpc.shape != "client_stream":
        assert len(bodies) == 1
    for body in bodies:
        message = rpc.request.FromString(body)
        assert message.ByteSize() == len(body)


@pytest.mark.parametrize("rpc", [r for r in RPCS if r.control], ids=lambda r: r.name)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_control_requests_never_name_what_the_mesh_serves(rpc: Rpc, data: st.DataObject) -> None:
    """A fuzzed unload of the served model, or a committed load of its view, would fail
    the valid trickle for a reason that is no input handling's."""
    for body in data.draw(structured(rpc, KNOWN)):
        message = rpc.request.FromString(body)
        for name in ("model_name", "model"):
            if name in message.DESCRIPTOR.fields_by_name and rpc.method != "WriteFeatures":
                assert getattr(message, name) not in KNOWN.models
        if rpc.method == "LoadFeatures" and message.HasField("header"):
            assert message.header.view not in KNOWN.views
        if rpc.method == "WriteFeatures":
            assert all(e.entity_id.startswith("fuzz-") for e in message.entities)


@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.name)
@settings(max_examples=5, deadline=None, database=None)
@given(data=st.data())
def test_raw_requests_are_bytes(rpc: Rpc, data: st.DataObject) -> None:
    bodies = data.draw(raw(rpc))
    assert all(isinstance(b, bytes) for b in bodies)
