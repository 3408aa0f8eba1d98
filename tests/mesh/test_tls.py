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
import socket
import ssl
import subprocess
import sys
from collections import Counter
from pathlib import Path

import grpc
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.identity import (
    EDGE_IDENTITY,
    ENVOY_IDENTITY,
    OPERATOR_IDENTITY,
    TRACE_STORE_IDENTITY,
    Dial,
    MeshIdentity,
    dial_address,
    dial_edge,
    mesh_identity,
)
from servemesh.identity.credentials import client_credentials, server_name_option
from servemesh.launcher import Mesh
from servemesh.load import Event, FixedRate, open_loop, predict_target
from servemesh.spec import MeshSpec
from tests.mesh.conftest import test_mesh_spec
from tests.waiting import wait_until

PROBE_TIMEOUT_S = 3.0


def _ports(mesh: Mesh) -> list[tuple[str, str, str]]:
    """(what, address, identity it must present) for every mesh listener and service."""
    spec = mesh.spec
    found = [(f"mesh listener {z}", spec.mesh_address_for(z), ENVOY_IDENTITY) for z in spec.zones]
    found += [(i.name, spec.address_of(i.name), i.name) for i in spec.instances()]
    if spec.embedded_trace_store_port is not None:
        store = f"{spec.host}:{spec.embedded_trace_store_port}"
        found.append(("trace store", store, TRACE_STORE_IDENTITY))
    return found


def _check(dial: Dial) -> grpc.StatusCode:
    with dial.channel() as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _stranger(tmp_path: Path, spec: MeshSpec) -> MeshIdentity:
    """A CA of the same mesh name and an operator certificate from it: right names, wrong CA."""
    other = MeshIdentity(tmp_path / "other", spec.name)
    other.ensure([OPERATOR_IDENTITY], days=1, extra_names={})
    return other


def test_every_mesh_port_refuses_plaintext_anonymous_and_foreign_clients(
    mesh: Mesh, tmp_path: Path
) -> None:
    spec = mesh.spec
    own = mesh_identity(spec)
    stranger = _stranger(tmp_path, spec)
    for what, address, server in _ports(mesh):
        name = server_name_option(own, server)
        anonymous = Dial(address, client_credentials(own, None), (name,))
        foreign = Dial(
            address,
            grpc.ssl_channel_credentials(
                root_certificates=own.trust_pem(),
                private_key=stranger.leaf(OPERATOR_IDENTITY).read().key_pem,
                certificate_chain=stranger.leaf(OPERATOR_IDENTITY).read().cert_pem,
            ),
            (name,),
        )
        assert _check(Dial(address, None)) == grpc.StatusCode.UNAVAILABLE, f"{what}: plaintext"
        assert _check(anonymous) == grpc.StatusCode.UNAVAILABLE, f"{what}: no client cert"
        assert _check(foreign) == grpc.StatusCode.UNAVAILABLE, f"{what}: another CA's cert"
        # Past the handshake: a replica answers its health, a mesh listener has no route for
        # a bare Health/Check (UNIMPLEMENTED); either way TLS let the call through.
        reached = _check(dial_address(spec, address, server))
        assert reached in (grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED), what


def test_a_client_checks_who_answers(mesh: Mesh) -> None:
    """A replica's certificate names it: dialled as another identity, the client hangs up."""
    spec = mesh.spec
    registry, model = (
        spec.registry_instance,
        next(i.name for i in spec.instances() if i.service == "model"),
    )
    assert _check(dial_address(spec, spec.address_of(registry), registry)) == grpc.StatusCode.OK
    wrong = dial_address(spec, spec.address_of(registry), model)
    assert _check(wrong) == grpc.StatusCode.UNAVAILABLE


def test_the_edge_serves_tls_to_callers_who_trust_the_mesh(mesh: Mesh, tmp_path: Path) -> None:
    spec = mesh.spec
    assert spec.tls.edge
    assert _check(dial_edge(spec)) == grpc.StatusCode.OK
    assert _check(Dial(spec.edge_address, None)) == grpc.StatusCode.UNAVAILABLE, "plaintext"
    stranger = _stranger(tmp_path, spec)
    distrusting = Dial(
        spec.edge_address,
        grpc.ssl_channel_credentials(root_certificates=stranger.trust_pem()),
        (server_name_option(stranger, EDGE_IDENTITY),),
    )
    assert _check(distrusting) == grpc.StatusCode.UNAVAILABLE


def _served_serial(address: str, identity: MeshIdentity, server: str, client: bool) -> int:
    """The serial of the certificate a fresh TLS handshake with `address` is shown."""
    context = ssl.create_default_context(cafile=str(identity.trust_file))
    context.set_alpn_protocols(["h2"])
    if client:
        leaf = identity.leaf(OPERATOR_IDENTITY)
        context.load_cert_chain(leaf.cert, leaf.key)
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S) as raw:
        hostname = f"{server}.{identity.mesh}.internal"
        with context.wrap_socket(raw, server_hostname=hostname) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _serial_of(identity: MeshIdentity, name: str) -> int:
    return identity.leaf(name).read().certificate.serial_number


def _rotate_all(mesh: Mesh) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "servemesh", "certs", "--state-dir", str(mesh.state_dir),
         "rotate"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout


def test_rotation_under_load_loses_nothing(mesh: Mesh) -> None:
    """Two rotations of every certificate during 10 s of 100 Predict/s through the edge:
    every request succeeds, and fresh handshakes then show the new certificates at the
    edge, at a mesh listener and at every replica."""
    spec = mesh.spec
    identity = mesh_identity(spec)
    before = {name: _serial_of(identity, name) for name in identity.identities()}
    target = predict_target(dial_edge(spec), entities=100, timeout_s=5.0)
    events = [Event(2.0, lambda: _rotate_all(mesh), "rotate"),
              Event(5.0, lambda: _rotate_all(mesh), "rotate again")]  # fmt: skip
    run = asyncio.run(open_loop(target, FixedRate(100, 10.0), events=events))

    assert [e.error for e in run.events] == ["", ""]
    codes = Counter(o.code for o in run.outcomes)
    assert codes == {"OK": len(run.outcomes)}, codes
    assert len(run.outcomes) >= 900

    after = {name: _serial_of(identity, name) for name in identity.identities()}
    assert all(after[name] != before[name] for name in before)
    # Envoy re-reads its SDS files when they move: wait for the first handshake showing
    # the new certificate, then every port must.
    zone = spec.zones[0]
    wait_until(
        lambda: (
            _served_serial(spec.edge_address, identity, EDGE_IDENTITY, False)
            == after[EDGE_IDENTITY]
        ),
        "the edge to show its new certificate",
    )
    wait_until(
        lambda: (
            _served_serial(spec.mesh_address_for(zone), identity, ENVOY_IDENTITY, True)
            == after[ENVOY_IDENTITY]
        ),
        "the mesh listener to show its new certificate",
    )
    for instance in spec.instances():
        served = _served_serial(spec.address_of(instance.name), identity, instance.name, True)
        assert served == after[instance.name], instance.name


def test_a_plaintext_edge_is_a_spec_switch(tmp_path: Path) -> None:
    """With tls.edge off, the edge answers plaintext (local debugging) while every hop
    behind it stays mutual TLS."""
    spec = test_mesh_spec(str(tmp_path / "state"), entities=10)
    spec = spec.model_copy(update={"tls": spec.tls.model_copy(update={"edge": False})})
    with Mesh.from_spec(spec) as running:
        assert _check(Dial(running.spec.edge_address, None)) == grpc.StatusCode.OK
        assert _check(dial_edge(running.spec)) == grpc.StatusCode.OK
        zone = running.spec.zones[0]
        listener = running.spec.mesh_address_for(zone)
        assert _check(Dial(listener, None)) == grpc.StatusCode.UNAVAILABLE
