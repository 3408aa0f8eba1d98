"""gRPC credentials from the mesh's certificates, for servers and for clients.

A server's credentials re-read its identity's `current` pair whenever a new connection's
handshake finds it moved (grpc's dynamic server credentials), so a rotation needs no
restart. A client's credentials are read once per channel: channels in the mesh live as
long as their process, and a connection already open keeps working after a rotation.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from servemesh.identity.authority import dns_name
from servemesh.identity.store import MeshIdentity

log = logging.getLogger(__name__)

Options = Sequence[tuple[str, Any]]


class _ServerCertificates:
    """grpc's certificate-configuration fetcher for one identity: a new configuration when
    the identity's `current` link or the trust bundle changed since the last handshake."""

    def __init__(self, identity: MeshIdentity, name: str) -> None:
        self.identity = identity
        self.name = name
        self._seen: tuple[str, float] | None = None
        self._lock = threading.Lock()

    def _stamp(self) -> tuple[str, float]:
        return (
            os.readlink(self.identity.current(self.name)),
            self.identity.trust_file.stat().st_mtime,
        )

    def configuration(self) -> Any:
        leaf = self.identity.leaf(self.name).read()
        return grpc.ssl_server_certificate_configuration(
            [(leaf.key_pem, leaf.cert_pem)], root_certificates=self.identity.trust_pem()
        )

    def __call__(self) -> Any:
        # Called by grpc on its own threads at every handshake: cheap when nothing moved,
        # and never raising (an exception here would fail the handshake).
        with self._lock:
            try:
                stamp = self._stamp()
                if stamp == self._seen:
                    return None
                fresh = self.configuration()
            except OSError as exc:
                log.warning("certificates unreadable, keeping the last ones: %s", exc)
                return None
            self._seen = stamp
            log.info("certificates loaded", extra={"generation": stamp[0]})
            return fresh


def server_credentials(identity: MeshIdentity, name: str) -> grpc.ServerCredentials:
    """Mutual TLS for a service's port: it presents `name`'s certificate and accepts only
    clients with a certificate from the mesh CA."""
    fetch = _ServerCertificates(identity, name)
    initial = fetch.configuration()
    fetch._seen = fetch._stamp()
    return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=True)


def client_credentials(identity: MeshIdentity, name: str | None) -> grpc.ChannelCredentials:
    """TLS for a channel: trust the mesh CA, present `name`'s certificate (None: none, as
    for a client of the edge)."""
    if name is None:
        return grpc.ssl_channel_credentials(root_certificates=identity.trust_pem())
    leaf = identity.leaf(name).read()
    return grpc.ssl_channel_credentials(
        root_certificates=identity.trust_pem(),
        private_key=leaf.key_pem,
        certificate_chain=leaf.cert_pem,
    )


def server_name_option(identity: MeshIdentity, server: str) -> tuple[str, str]:
    """The channel option that makes a client verify it reached `server`'s identity, whatever
    address it dialled (zone namespaces, loopback aliases)."""
    return ("grpc.ssl_target_name_override", dns_name(server, identity.mesh))
