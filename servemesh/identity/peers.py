"""Who is on the other end of a mutual-TLS call: the peer's SPIFFE id, from gRPC's auth
context, and the mesh identity (an instance name, `operator`, `envoy`) it names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grpc

from servemesh.identity.authority import spiffe_id

# Where gRPC's TLS auth context carries the certificate's URI SAN, newest name first.
PEER_PROPERTIES = ("peer_spiffe_id", "peer_uri")


def peer_spiffe_id(auth: Mapping[str, Iterable[bytes]]) -> str:
    """The peer's SPIFFE id from an auth context ("" when it shows none: plaintext)."""
    for name in PEER_PROPERTIES:
        for value in auth.get(name) or ():
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if text.startswith("spiffe://"):
                return text
    return ""


def peer_identity(context: grpc.aio.ServicerContext, mesh: str) -> str:
    """The mesh identity of a call's peer (`model-fraud-zone-a-0`, `operator`), "" when the
    call is plaintext or the peer's certificate is not of mesh `mesh`."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # a plaintext test server has no auth context to speak of
        return ""
    prefix = spiffe_id("", mesh)
    found = peer_spiffe_id(auth)
    return found[len(prefix) :] if found.startswith(prefix) else ""
