"""How a caller given every edge dials them: one gRPC target listing each edge, round robin
over them and an UNAVAILABLE call retried (docs/architecture.md, "Calling the mesh")."""

from __future__ import annotations

import json

import pytest

from servemesh.identity import dial_edges, edges_target
from servemesh.spec import MeshSpec


def test_one_edge_is_its_own_address_and_several_are_one_address_list() -> None:
    assert edges_target(["127.0.0.1:8080"]) == "127.0.0.1:8080"
    assert edges_target(["edge.example:8080"]) == "edge.example:8080"
    assert edges_target(["127.0.0.1:8080", "localhost:8180"]) == (
        "ipv4:127.0.0.1:8080,127.0.0.1:8180"
    )
    assert edges_target(["[::1]:8080", "[::1]:8180"]) == "ipv6:[::1]:8080,[::1]:8180"


@pytest.mark.parametrize(
    ("addresses", "says"),
    [
        ([], "no edge address"),
        (["edge-a.example:8080", "edge-b.example:8080"], "one DNS name"),
        (["127.0.0.1:8080", "[::1]:8180"], "IPv4 and IPv6"),
    ],
)
def test_lists_grpc_cannot_dial_are_refused_saying_what_to_do(
    addresses: list[str], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        edges_target(addresses)


def test_the_caller_spreads_calls_and_retries_one_an_edge_lost() -> None:
    spec = MeshSpec.model_validate({"tls": {"edge": False}})
    plan = dial_edges(spec, ["127.0.0.1:8080", "127.0.0.1:8180"])
    options = dict(plan.options)
    config = json.loads(options["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    [method] = config["methodConfig"]
    assert method["name"] == [{}]  # every method of the edge
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert method["retryPolicy"]["maxAttempts"] >= 2
    assert options["grpc.default_authority"] == "127.0.0.1:8080"
    assert plan.credentials is None  # edge TLS off: plaintext, as dial_edge_at
