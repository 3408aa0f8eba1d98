"""What a TLS check of a running mesh asks of each port, shared by the TLS tests of both
Envoy layouts (tests/mesh/test_tls.py: one Envoy; tests/mesh/test_zone_proxies.py: the
edge's and one per zone): strangers refused at every port, and a rotation served by every
listener and replica."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
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
    mesh_identity,
)
from servemesh.identity.credentials import client_credentials, server_name_option
from servemesh.launcher import Mesh
from servemesh.spec import MeshSpec
from tests.waiting import wait_until

PROBE_TIMEOUT_S = 3.0


def mesh_ports(mesh: Mesh) -> list[tuple[str, str, str]]:
    """(what, address, identity it must present) for every mesh listener and service."""
    spec = mesh.spec
    found = [(f"mesh listener {z}", spec.mesh_address_for(z), ENVOY_IDENTITY) for z in spec.zones]
    found += [(i.name, spec.address_of(i.name), i.name) for i in spec.instances()]
    if spec.embedded_trace_store_port is not None:
        store = f"{spec.host}:{spec.embedded_trace_store_port}"
        found.append(("trace store", store, TRACE_STORE_IDENTITY))
    return found


def health_check(dial: Dial) -> grpc.StatusCode:
    with dial.channel() as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def stranger(tmp_path: Path, spec: MeshSpec) -> MeshIdentity:
    """A CA of the same mesh name and an operator certificate from it: right names, wrong CA."""
    other = MeshIdentity(tmp_path / "other", spec.name)
    other.ensure([OPERATOR_IDENTITY], days=1, extra_names={})
    return other


def assert_strangers_refused(mesh: Mesh, tmp_path: Path) -> None:
    """Every mesh listener and service port refuses plaintext, TLS without a client
    certificate and a certificate from another CA, and lets the mesh's operator through."""
    spec = mesh.spec
    own = mesh_identity(spec)
    foreign_ca = stranger(tmp_path, spec)
    for what, address, server in mesh_ports(mesh):
        name = server_name_option(own, server)
        anonymous = Dial(address, client_credentials(own, None), (name,))
        foreign = Dial(
            address,
            grpc.ssl_channel_credentials(
                root_certificates=own.trust_pem(),
                private_key=foreign_ca.leaf(OPERATOR_IDENTITY).read().key_pem,
                certificate_chain=foreign_ca.leaf(OPERATOR_IDENTITY).read().cert_pem,
            ),
            (name,),
        )
        plain = health_check(Dial(address, None))
        assert plain == grpc.StatusCode.UNAVAILABLE, f"{what}: plaintext"
        assert health_check(anonymous) == grpc.StatusCode.UNAVAILABLE, f"{what}: no client cert"
        assert health_check(foreign) == grpc.StatusCode.UNAVAILABLE, f"{what}: another CA's cert"
        # Past the handshake: a replica answers its health, a mesh listener has no route for
        # a bare Health/Check (UNIMPLEMENTED); either way TLS let the call through.
        reached = health_check(dial_address(spec, address, server))
        assert reached in (grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED), what


def served_serial(address: str, identity: MeshIdentity, server: str, client: bool) -> int:
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


def serials(identity: MeshIdentity) -> dict[str, int]:
    """Every identity's live certificate serial, as its files hold it."""
    return {
        name: identity.leaf(name).read().certificate.serial_number for name in identity.identities()
    }


def rotate_all(mesh: Mesh) -> str:
    """`servemesh certs rotate` for every identity, as an operator runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "servemesh", "certs", "--state-dir", str(mesh.state_dir),
         "rotate"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout


def assert_rotation_served(mesh: Mesh, after: dict[str, int]) -> None:
    """Fresh handshakes show the certificates `after` names at the edge, at every zone's
    mesh listener (one Envoy's each, in the per-zone layout) and at every replica.

    Envoy re-reads its SDS files when they move: each listener is waited for until its
    first handshake shows the new certificate; the replicas' servers show it at once."""
    spec = mesh.spec
    identity = mesh_identity(spec)
    wait_until(
        lambda: (
            served_serial(spec.edge_address, identity, EDGE_IDENTITY, False) == after[EDGE_IDENTITY]
        ),
        "the edge to show its new certificate",
    )
    for zone in spec.zones:
        address = spec.mesh_address_for(zone)

        def shows_new(address: str = address) -> bool:
            return served_serial(address, identity, ENVOY_IDENTITY, True) == after[ENVOY_IDENTITY]

        wait_until(shows_new, f"{zone}'s mesh listener to show its new certificate")
    for instance in spec.instances():
        served = served_serial(spec.address_of(instance.name), identity, instance.name, True)
        assert served == after[instance.name], instance.name
