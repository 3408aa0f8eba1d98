"""Envoy's transport sockets: TLS at the edge, mutual TLS on every other hop.

Envoy reads its certificates through SDS from files under `<state_dir>/tls/sds` (see
servemesh.identity.store), so a rotation is a file swap Envoy notices, like every other
resource it is given. It presents one identity ("envoy") on the mesh listeners and to
every service, and a second ("edge") to the mesh's callers.
"""

from __future__ import annotations

from typing import Any

from servemesh.identity.authority import spiffe_id
from servemesh.identity.enroll import EDGE_IDENTITY, ENVOY_IDENTITY, mesh_identity
from servemesh.identity.store import TRUST_SECRET, MeshIdentity
from servemesh.spec import MeshSpec

_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."


def _sds(identity: MeshIdentity, secret: str) -> dict[str, Any]:
    path = identity.sds_file(secret)
    return {
        "name": secret,
        "sds_config": {
            # Re-read when a file is renamed into the folder (the store's atomic swap).
            "path_config_source": {
                "path": str(path),
                "watched_directory": {"path": str(path.parent)},
            },
            "resource_api_version": "V3",
        },
    }


def downstream_tls(spec: MeshSpec, *, edge: bool) -> dict[str, Any]:
    """A listener's TLS: the edge shows the edge certificate and asks callers for an optional
    one, verified against the mesh CA when sent (a caller without one authenticates at the
    edge's auth filter; one with it is named to the gateway, x-forwarded-client-cert); a
    mesh listener accepts only mesh certificates."""
    identity = mesh_identity(spec)
    context: dict[str, Any] = {
        "@type": _TLS + "DownstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": ["h2"] if not edge else ["h2", "http/1.1"],
            "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
            "tls_certificate_sds_secret_configs": [
                _sds(identity, EDGE_IDENTITY if edge else ENVOY_IDENTITY)
            ],
        },
    }
    # Both ask for a client certificate and verify it against the mesh CA; only the mesh
    # listeners refuse a connection without one. A certificate that does not verify fails
    # the handshake at the edge too.
    context["require_client_certificate"] = not edge
    context["common_tls_context"]["validation_context_sds_secret_config"] = _sds(
        identity, TRUST_SECRET
    )
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def upstream_tls(spec: MeshSpec, service_kind: str) -> dict[str, Any]:
    """A cluster's TLS to the replicas of one service kind: Envoy shows its own certificate
    and accepts only a replica whose certificate names an instance of that kind."""
    identity = mesh_identity(spec)
    prefix = spiffe_id(f"{service_kind}-", spec.name)
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _TLS + "UpstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "tls_certificate_sds_secret_configs": [_sds(identity, ENVOY_IDENTITY)],
                "combined_validation_context": {
                    "default_validation_context": {
                        "match_typed_subject_alt_names": [
                            {"san_type": "URI", "matcher": {"prefix": prefix}}
                        ]
                    },
                    "validation_context_sds_secret_config": _sds(identity, TRUST_SECRET),
                },
            },
        },
    }
