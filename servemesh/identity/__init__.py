"""The mesh's identities: its CA, a certificate per service, and the TLS every hop speaks.

issue_mesh_certificates(spec)                  # `up`: the CA and every certificate
dial_service(spec, "model-fraud-zone-a-0").channel() # mTLS to a replica, as the operator
dial_mesh(spec, zone, caller=instance)         # a service to its zone's mesh listener
dial_edge(spec)                                # a client of the edge (TLS, no cert)
dial_every_edge(spec)                          # a caller given every zone's edge
serving_credentials(spec, instance)            # a service's own port
"""

from __future__ import annotations

import grpc

from servemesh.identity.channels import (
    Dial,
    across_edges,
    dial_address,
    dial_edge,
    dial_edge_at,
    dial_edges,
    dial_every_edge,
    dial_mesh,
    dial_registry,
    dial_registry_mirror,
    dial_service,
    edges_target,
)
from servemesh.identity.credentials import server_credentials
from servemesh.identity.enroll import (
    EDGE_IDENTITY,
    ENVOY_IDENTITY,
    OPERATOR_IDENTITY,
    TRACE_STORE_IDENTITY,
    enrolled,
    issue_mesh_certificates,
    mesh_identities,
    mesh_identity,
)
from servemesh.identity.store import MeshIdentity
from servemesh.spec import MeshSpec

__all__ = [
    "EDGE_IDENTITY",
    "ENVOY_IDENTITY",
    "OPERATOR_IDENTITY",
    "TRACE_STORE_IDENTITY",
    "Dial",
    "MeshIdentity",
    "dial_address",
    "across_edges",
    "dial_edge",
    "dial_edge_at",
    "dial_edges",
    "dial_every_edge",
    "edges_target",
    "dial_mesh",
    "dial_registry",
    "dial_registry_mirror",
    "dial_service",
    "issue_mesh_certificates",
    "mesh_identities",
    "mesh_identity",
    "serving_credentials",
]


def serving_credentials(spec: MeshSpec, instance: str) -> grpc.ServerCredentials:
    """Mutual TLS for `instance`'s port, with its certificate issued if it has none yet."""
    return server_credentials(enrolled(spec, instance), instance)
