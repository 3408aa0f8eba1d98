"""Every hop is TLS: plaintext and strangers are refused at each port, and certificates
rotate under load without a failed request.

Each listener and service port of a real mesh is dialled four ways: plaintext, TLS with no
client certificate, mutual TLS with a certificate from another CA, and mutual TLS with the
mesh's own operator certificate. Only the last may get an answer (the edge, which serves
callers without certificates, also answers TLS without one, and refuses a client that does
not trust it).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import grpc

from servemesh.identity import EDGE_IDENTITY, Dial, dial_address, dial_edge, mesh_identity
from servemesh.identity.credentials import server_name_option
from servemesh.launcher import Mesh
from servemesh.load import Event, FixedRate, open_loop, predict_target
from tests.mesh.conftest import test_mesh_spec
from tests.mesh.tls_probe import (
    assert_rotation_served,
    assert_strangers_refused,
    health_check,
    rotate_all,
    serials,
    stranger,
)


def test_every_mesh_port_refuses_plaintext_anonymous_and_foreign_clients(
    mesh: Mesh, tmp_path: Path
) -> None:
    assert_strangers_refused(mesh, tmp_path)


def test_a_client_checks_who_answers(mesh: Mesh) -> None:
    """A replica's certificate names it: dialled as another identity, the client hangs up."""
    spec = mesh.spec
    registry, model = (
        spec.registry_instance,
        next(i.name for i in spec.instances() if i.service == "model"),
    )
    assert (
        health_check(dial_address(spec, spec.address_of(registry), registry)) == grpc.StatusCode.OK
    )
    wrong = dial_address(spec, spec.address_of(registry), model)
    assert health_check(wrong) == grpc.StatusCode.UNAVAILABLE


def test_the_edge_serves_tls_to_callers_who_trust_the_mesh(mesh: Mesh, tmp_path: Path) -> None:
    spec = mesh.spec
    assert spec.tls.edge
    assert health_check(dial_edge(spec)) == grpc.StatusCode.OK
    assert health_check(Dial(spec.edge_address, None)) == grpc.StatusCode.UNAVAILABLE, "plaintext"
    foreign_ca = stranger(tmp_path, spec)
    distrusting = Dial(
        spec.edge_address,
        grpc.ssl_channel_credentials(root_certificates=foreign_ca.trust_pem()),
        (server_name_option(foreign_ca, EDGE_IDENTITY),),
    )
    assert health_check(distrusting) == grpc.StatusCode.UNAVAILABLE


def test_rotation_under_load_loses_nothing(mesh: Mesh) -> None:
    """Two rotations of every certificate during 10 s of 100 Predict/s through the edge:
    every request succeeds, and fresh handshakes then show the new certificates at the
    edge, at every mesh listener and at every replica."""
    spec = mesh.spec
    identity = mesh_identity(spec)
    before = serials(identity)
    target = predict_target(dial_edge(spec), entities=100, timeout_s=5.0)
    events = [Event(2.0, lambda: rotate_all(mesh), "rotate"),
              Event(5.0, lambda: rotate_all(mesh), "rotate again")]  # fmt: skip
    run = asyncio.run(open_loop(target, FixedRate(100, 10.0), events=events))

    assert [e.error for e in run.events] == ["", ""]
    codes = Counter(o.code for o in run.outcomes)
    assert codes == {"OK": len(run.outcomes)}, codes
    assert len(run.outcomes) >= 900

    after = serials(identity)
    assert all(after[name] != before[name] for name in before)
    assert_rotation_served(mesh, after)


def test_a_plaintext_edge_is_a_spec_switch(tmp_path: Path) -> None:
    """With tls.edge off, the edge answers plaintext (local debugging) while every hop
    behind it stays mutual TLS."""
    spec = test_mesh_spec(str(tmp_path / "state"), entities=10)
    spec = spec.model_copy(update={"tls": spec.tls.model_copy(update={"edge": False})})
    with Mesh.from_spec(spec) as running:
        assert health_check(Dial(running.spec.edge_address, None)) == grpc.StatusCode.OK
        assert health_check(dial_edge(running.spec)) == grpc.StatusCode.OK
        zone = running.spec.zones[0]
        listener = running.spec.mesh_address_for(zone)
        assert health_check(Dial(listener, None)) == grpc.StatusCode.UNAVAILABLE
