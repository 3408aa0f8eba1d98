"""A short fuzz campaign on a real mesh: every public RPC, through Envoy and directly.

The long one is `servemesh fuzz --requests 10000` (docs/security.md, "Fuzzing").
"""

from __future__ import annotations

import grpc
import pytest

from servemesh.fuzz.campaign import routes_of, run_campaign, send
from servemesh.fuzz.rpcs import RPCS, Rpc
from servemesh.identity import dial_mesh
from servemesh.launcher import Mesh
from servemesh.services.runtime.errors import MAX_WIRE_MESSAGE_CHARS
from servemesh_api.inference import grpc_service_pb2 as oip

# Field 1 (a string) claiming 2**31 bytes, then three: no message of any type.
CORRUPT = b"\x0a\x80\x80\x80\x80\x08abc"

pytestmark = pytest.mark.mesh


def test_a_short_campaign_finds_nothing_and_valid_predicts_keep_succeeding(
    fuzz_mesh: Mesh,
) -> None:
    requests = 12 * len(RPCS)
    report = run_campaign(fuzz_mesh, requests, seed=1)

    assert report.requests == requests
    for name, tally in report.rpcs.items():
        assert tally.requests >= 10, name
        assert sum(tally.statuses.values()) == tally.requests, name
    vias = {via for tally in report.rpcs.values() for via in tally.by_via}
    assert vias == {"envoy", "direct"}
    assert report.findings == [], [f.__dict__ for f in report.findings]
    assert report.dead == {}
    assert report.over_bound() == {}
    assert report.valid_sent > 0
    assert report.valid_failures == []
    assert report.ok


# Control calls without the control credential are refused before their body is read.
DATA_PLANE_UNARY = [r for r in RPCS if r.shape == "unary" and not r.control]


@pytest.mark.parametrize("rpc", DATA_PLANE_UNARY, ids=lambda r: r.name)
def test_an_undecodable_body_through_envoy_is_invalid_argument(fuzz_mesh: Mesh, rpc: Rpc) -> None:
    """Found by the campaign: was UNKNOWN "Unexpected <class '...DecodeError'>"."""
    route = routes_of(fuzz_mesh.spec)[rpc.api][0]
    with route.dial.channel() as channel:
        outcome = send(channel, rpc, [CORRUPT], route.metadata, timeout_s=5)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome.details
    assert outcome.details == f"request: not a {rpc.request.DESCRIPTOR.full_name} message"


def test_a_huge_name_through_a_mesh_listener_gets_its_status_not_a_reset(
    fuzz_mesh: Mesh,
) -> None:
    """Found by the campaign: the NOT_FOUND echoing a 70,000-character model name did not
    fit Envoy's header limit, and the caller got "upstream ... reset"."""
    request = oip.ModelStatisticsRequest(name="a" * 70_000)
    rpc = next(r for r in RPCS if r.method == "ModelStatistics")
    with dial_mesh(fuzz_mesh.spec, fuzz_mesh.spec.zones[0]).channel() as channel:
        outcome = send(channel, rpc, [request.SerializeToString()], (), timeout_s=5)
    assert outcome.code == grpc.StatusCode.NOT_FOUND, outcome.details
    assert len(outcome.details) <= MAX_WIRE_MESSAGE_CHARS
