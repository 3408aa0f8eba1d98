"""Dialling the edge with a client certificate: the operator's tools at the edge.

The edge's TLS asks every caller for an optional certificate from the mesh CA and passes
the verified one on to the gateway (x-forwarded-client-cert). A caller presenting the
operator's certificate is the operator wherever it comes from (the gateway lets it pin
any version); one presenting none authenticates with the edge's auth mode alone.
"""

from __future__ import annotations

from servemesh.identity.channels import Dial, dial_edge_at
from servemesh.identity.credentials import client_credentials, server_name_option
from servemesh.identity.enroll import EDGE_IDENTITY, OPERATOR_IDENTITY, enrolled
from servemesh.spec import MeshSpec


def dial_edge_as(spec: MeshSpec, target: str, caller: str | None = OPERATOR_IDENTITY) -> Dial:
    """To the edge at `target`, presenting `caller`'s certificate (None: none, as
    identity.dial_edge_at); plaintext when the spec turns edge TLS off."""
    if caller is None or not spec.tls.edge:
        return dial_edge_at(spec, target)
    identity = enrolled(spec, caller)
    return Dial(
        target,
        client_credentials(identity, caller),
        (server_name_option(identity, EDGE_IDENTITY),),
    )
