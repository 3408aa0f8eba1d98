"""How every client in the mesh dials: the address, the credentials, the name to verify.

`Dial` is a plan for a channel; `.channel()` and `.aio_channel()` open it. Every hop
inside the mesh is mutual TLS: the caller presents its own certificate (a service its
instance's, a tool the operator's) and checks that the far end is who it should be.
The edge is TLS without a client certificate (callers authenticate at the edge), or
plaintext when the spec turns edge TLS off.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from servemesh.identity.credentials import client_credentials, server_name_option
from servemesh.identity.enroll import EDGE_IDENTITY, ENVOY_IDENTITY, OPERATOR_IDENTITY, enrolled
from servemesh.spec import MeshSpec, ResolvedSpec, registry_mirror_name

Option = tuple[str, Any]


@dataclass(frozen=True)
class Dial:
    """Where to connect and how; None credentials: plaintext."""

    address: str
    credentials: grpc.ChannelCredentials | None
    options: tuple[Option, ...] = field(default=())

    def _options(self, extra: Sequence[Option]) -> list[Option]:
        return [*self.options, *extra]

    def channel(self, options: Sequence[Option] = ()) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.address, options=self._options(options))
        return grpc.secure_channel(self.address, self.credentials, options=self._options(options))

    def aio_channel(
        self,
        options: Sequence[Option] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
    ) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(
                self.address, options=self._options(options), interceptors=interceptors
            )
        return grpc.aio.secure_channel(
            self.address, self.credentials, options=self._options(options),
            interceptors=interceptors,
        )  # fmt: skip


def dial_address(
    spec: MeshSpec, address: str, server: str, *, caller: str = OPERATOR_IDENTITY
) -> Dial:
    """Mutual TLS to `address`, which must present `server`'s certificate."""
    identity = enrolled(spec, caller)
    return Dial(
        address, client_credentials(identity, caller), (server_name_option(identity, server),)
    )


def dial_service(spec: ResolvedSpec, instance: str, *, caller: str = OPERATOR_IDENTITY) -> Dial:
    """Straight to a service replica's own port (control calls, probes, drills)."""
    return dial_address(spec, spec.address_of(instance), instance, caller=caller)


def dial_registry(spec: ResolvedSpec, *, caller: str = OPERATOR_IDENTITY) -> Dial:
    return dial_service(spec, spec.registry_instance, caller=caller)


def dial_registry_mirror(
    spec: ResolvedSpec, zone: str, *, caller: str = OPERATOR_IDENTITY
) -> Dial | None:
    """To `zone`'s mirror of the registry (registry.mirrors); None when the zone has none."""
    address = spec.registry_mirror_address(zone)
    if address is None:
        return None
    return dial_address(spec, address, registry_mirror_name(zone), caller=caller)


def dial_mesh(spec: ResolvedSpec, zone: str, *, caller: str = OPERATOR_IDENTITY) -> Dial:
    """To a zone's Envoy mesh listener (what services call each other through)."""
    return dial_address(spec, spec.mesh_address_for(zone), ENVOY_IDENTITY, caller=caller)


def dial_edge(spec: ResolvedSpec) -> Dial:
    """To the first zone's edge listener alone: TLS trusting the mesh CA, or plaintext when
    tls.edge is off (what tests of one edge's own behaviour dial; callers: dial_edges)."""
    return dial_edge_at(spec, spec.edge_address)


# How a caller given every edge dials them (docs/architecture.md, "Calling the mesh"): a
# connection to each, calls spread round robin over those that are up, and a call that
# failed UNAVAILABLE before any answer began (its edge died, or refused the connection)
# sent again, so one edge's loss costs no call. A Predict changes nothing but the
# prediction log, where one sent twice can appear twice.
EDGE_RETRY_ATTEMPTS = 3
# The first and the longest wait before dialling a lost edge again, in ms.
EDGE_RECONNECT_BACKOFF_MS = (100, 1000)
EDGE_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            "name": [{}],
            "retryPolicy": {
                "maxAttempts": EDGE_RETRY_ATTEMPTS,
                "initialBackoff": "0.02s",
                "maxBackoff": "0.2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}


def edges_target(addresses: Sequence[str]) -> str:
    """One gRPC target naming every edge: the address itself for one, else an ipv4: (or
    ipv6:) list of them. Several edges known by host name are one DNS name to the caller
    (every edge an address of it), which gRPC resolves itself; a list of names is refused."""
    if not addresses:
        raise ValueError("no edge address given")
    if len(addresses) == 1:
        return addresses[0]
    families = set()
    literal = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        host = "127.0.0.1" if host == "localhost" else host
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"edge {address!r}: several edges are dialled by address; give callers one "
                "DNS name holding every edge's address instead"
            ) from None
        families.add(ip.version)
        literal.append(f"[{host}]:{port}" if ip.version == 6 else f"{host}:{port}")
    if len(families) > 1:
        raise ValueError(f"edges {list(addresses)}: IPv4 and IPv6 addresses in one list")
    scheme = "ipv6" if families == {6} else "ipv4"
    return f"{scheme}:{','.join(literal)}"


def dial_edges(spec: MeshSpec, addresses: Sequence[str]) -> Dial:
    """To every edge of `spec`'s mesh at once (`addresses`: each zone's edge), as a caller
    is meant to connect: round robin over the edges that are up, an UNAVAILABLE call
    retried on another (EDGE_SERVICE_CONFIG)."""
    return across_edges(dial_edge_at(spec, addresses[0]), addresses)


def across_edges(plan: Dial, addresses: Sequence[str]) -> Dial:
    """`plan` (a way to dial one edge: its credentials and name to verify) made to dial
    every edge in `addresses` as dial_edges does."""
    options: tuple[Option, ...] = (
        ("grpc.service_config", json.dumps(EDGE_SERVICE_CONFIG)),
        ("grpc.enable_retries", 1),
        # An edge that comes back is dialled again within a second (gRPC's default back-off
        # grows to two minutes): until then the caller has one edge fewer, and losing
        # another meanwhile would leave it none.
        ("grpc.initial_reconnect_backoff_ms", EDGE_RECONNECT_BACKOFF_MS[0]),
        ("grpc.min_reconnect_backoff_ms", EDGE_RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", EDGE_RECONNECT_BACKOFF_MS[1]),
        # The :authority callers send: the first edge's (the target is a list).
        ("grpc.default_authority", addresses[0]),
    )
    return Dial(edges_target(addresses), plan.credentials, plan.options + options)


def dial_every_edge(spec: ResolvedSpec) -> Dial:
    """To every edge of a running mesh (dial_edges over spec.edge_addresses)."""
    return dial_edges(spec, spec.edge_addresses)


def dial_edge_at(spec: MeshSpec, target: str) -> Dial:
    """To an edge listener of `spec`'s mesh at `target` (an address given by hand)."""
    if not spec.tls.edge:
        return Dial(target, None)
    identity = enrolled(spec, None)
    return Dial(
        target, client_credentials(identity, None), (server_name_option(identity, EDGE_IDENTITY),)
    )
