"""Who is calling the gateway, and whether they may pin a version the traffic split skips.

A gateway is reached two ways, both over mutual TLS with a certificate from the mesh CA:

- through Envoy's edge: the TLS peer is Envoy (`spiffe://<mesh>/envoy`). Only then does the
  gateway read what the edge established about the caller, in headers a caller cannot
  forge there: CALLER_ROLE_HEADER / CALLER_HEADER (the role and subject of a token Envoy's
  jwt_authn verified; a caller's own copies are removed before any auth filter) and
  CLIENT_CERT_HEADER (the caller's verified certificate, SANITIZE_SET: a caller's copy is
  replaced).
- directly on its own port (an operator's tool): the TLS peer is the caller.

Pinning a version with weight 0 (a canary the split does not send traffic to yet, an old
version kept for rollback) is an operator's act: it steers the version's counters, and so
a rollout's analysis. It needs a role in `traffic.edge_auth.pin_roles` (`operator` by
default), or the operator's certificate (`spiffe://<mesh>/operator`) at the edge or on the
gateway's own port. Pinning a version that has weight is allowed to every caller: it is
a version the split serves them anyway, and its calls are counted apart (route="pinned").
Weights are the ones in the spec this gateway follows (`servemesh apply` and `routes
set-weights` rewrite it; every gateway takes the change within its spec poll).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc

from servemesh.contract.echo import shown
from servemesh.contract.wire import CALLER_HEADER, CALLER_ROLE_HEADER, CLIENT_CERT_HEADER
from servemesh.identity.authority import spiffe_id
from servemesh.identity.enroll import ENVOY_IDENTITY, OPERATOR_IDENTITY
from servemesh.identity.peers import peer_spiffe_id
from servemesh.services.runtime.errors import PermissionDenied
from servemesh.spec import MeshSpec


@dataclass(frozen=True)
class Caller:
    """What the gateway knows of one call's caller."""

    peer: str = ""  # the TLS peer's SPIFFE id ("" on a plaintext port)
    via_edge: bool = False  # the peer is Envoy: the edge's headers below are Envoy's
    role: str = ""  # a verified token's role ("" without one)
    subject: str = ""  # a verified token's subject, or a basic-auth user
    certificate: str = ""  # the URI of the caller's verified certificate at the edge


def client_cert_uri(value: str) -> str:
    """The URI of the current element of an x-forwarded-client-cert value (Envoy's format:
    `;`-separated key=value pairs, values maybe quoted, elements `,`-separated; with
    SANITIZE_SET there is one element, Envoy's own)."""
    element = value.rsplit(",", 1)[-1]
    for pair in element.split(";"):
        key, _, raw = pair.partition("=")
        if key.strip().lower() == "uri":
            return raw.strip().strip('"')
    return ""


def caller_from(
    spec: MeshSpec,
    auth: Mapping[str, Iterable[bytes]],
    metadata: Iterable[tuple[str, str | bytes]],
) -> Caller:
    """The caller of a call whose TLS auth context is `auth` and metadata `metadata`."""
    peer = peer_spiffe_id(auth)
    if peer != spiffe_id(ENVOY_IDENTITY, spec.name):
        return Caller(peer=peer)  # a direct caller: nothing it says about itself counts
    headers = {k: v for k, v in metadata if isinstance(v, str)}
    return Caller(
        peer=peer,
        via_edge=True,
        role=headers.get(CALLER_ROLE_HEADER, ""),
        subject=headers.get(CALLER_HEADER, ""),
        certificate=client_cert_uri(headers.get(CLIENT_CERT_HEADER, "")),
    )


def caller_of(spec: MeshSpec, context: grpc.aio.ServicerContext) -> Caller:
    try:
        auth = context.auth_context() or {}
    except Exception:  # a plaintext test server has no auth context to speak of
        auth = {}
    return caller_from(spec, auth, context.invocation_metadata() or ())


def may_pin_any_version(spec: MeshSpec, caller: Caller) -> bool:
    """Whether `caller` may pin a version the traffic split gives 0%."""
    operator = spiffe_id(OPERATOR_IDENTITY, spec.name)
    if caller.via_edge:
        return caller.role in spec.traffic.edge_auth.pin_roles or caller.certificate == operator
    return caller.peer == operator


def check_pin(
    spec: MeshSpec, model: str, version: str, caller: Caller | Callable[[], Caller]
) -> None:
    """PermissionDenied naming `version` when `caller` pins a version of `model` that the
    traffic split gives 0% and may not. `caller` may be a function giving it: the caller is
    then worked out only for such a pin (reading the call's auth context and headers cost
    a tenth of a cached answer's time in the gateway)."""
    if not version:
        return
    entry = spec.models.get(model)
    if entry is None or entry.traffic.get(version, 0) > 0:
        return
    if may_pin_any_version(spec, caller() if callable(caller) else caller):
        return
    roles = ", ".join(spec.traffic.edge_auth.pin_roles) or "none"
    raise PermissionDenied(
        f"version: pinning {shown(version)} (no share of the traffic split) needs a caller "
        f"role allowed to pin ({roles}) or the operator's certificate"
    )
