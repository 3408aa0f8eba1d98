"""How every client in the mesh dials: the address, the credentials, the name to verify.

`Dial` is a plan for a channel; `.channel()` and `.aio_channel()` open it. Every hop
inside the mesh is mutual TLS: the caller presents its own certificate (a service its
instance's, a tool the operator's) and checks that the far end is who it should be.
The edge is TLS without a client certificate (callers authenticate at the edge), or
plaintext when the spec turns edge TLS off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from servemesh.identity.credentials import client_credentials, server_name_option
from servemesh.identity.enroll import EDGE_IDENTITY, ENVOY_IDENTITY, OPERATOR_IDENTITY, enrolled
from servemesh.spec import MeshSpec, ResolvedSpec

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


def dial_mesh(spec: ResolvedSpec, zone: str, *, caller: str = OPERATOR_IDENTITY) -> Dial:
    """To a zone's Envoy mesh listener (what services call each other through)."""
    return dial_address(spec, spec.mesh_address_for(zone), ENVOY_IDENTITY, caller=caller)


def dial_edge(spec: ResolvedSpec) -> Dial:
    """To the edge listener: TLS trusting the mesh CA, or plaintext when tls.edge is off."""
    return dial_edge_at(spec, spec.edge_address)


def dial_edge_at(spec: MeshSpec, target: str) -> Dial:
    """To an edge listener of `spec`'s mesh at `target` (an address given by hand)."""
    if not spec.tls.edge:
        return Dial(target, None)
    identity = enrolled(spec, None)
    return Dial(
        target, client_credentials(identity, None), (server_name_option(identity, EDGE_IDENTITY),)
    )
