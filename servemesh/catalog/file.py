"""A catalog of service instances, and the file catalog: the resolved spec's own instances."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from typing import Protocol

from servemesh.spec import ResolvedSpec, ServiceKind

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class CatalogEntry:
    """One instance of a service as a catalog knows it."""

    kind: ServiceKind
    instance: str
    zone: str
    # An IP address: Envoy's endpoint files take no host names.
    address: str
    port: int
    # Every health check of the instance passes (only such instances become endpoints).
    passing: bool = True


class Catalog(Protocol):
    """Every instance of a service kind, and a way to wait for that list to change."""

    def watch(self, kind: ServiceKind, index: int, wait_s: float) -> tuple[int, list[CatalogEntry]]:
        """The instances of `kind` now, with the catalog's index. Given the index of an
        earlier answer, block until the catalog moved past it or `wait_s` passed."""
        ...

    def close(self) -> None:
        """Release any watcher blocked in `watch` (it answers at once)."""
        ...


def ip_of(host: str) -> str | None:
    """The first IPv4 or IPv6 address `host` resolves to (itself when it is one); None when
    it does not resolve (yet: a container that has not started)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    return str(found[0][4][0]) if found else None


class FileCatalog:
    """The spec's instances at `discovery.hosts` (else `host`) and their ports, all passing:
    Envoy's own health checks judge them. Names are resolved to addresses on each call."""

    INDEX = 1

    def __init__(self, spec: ResolvedSpec) -> None:
        self.spec = spec
        self._closed = threading.Event()

    def entries(self, kind: ServiceKind) -> list[CatalogEntry]:
        found = []
        for inst in self.spec.instances():
            if inst.service != kind:
                continue
            host = self.spec.host_of(inst.name)
            address = ip_of(host)
            if address is None:
                log.warning("no address for %s yet (%s does not resolve)", inst.name, host)
                continue
            found.append(
                CatalogEntry(kind, inst.name, inst.zone, address, self.spec.port_of(inst.name))
            )
        return found

    def watch(self, kind: ServiceKind, index: int, wait_s: float) -> tuple[int, list[CatalogEntry]]:
        # The spec does not change under a running catalog: a watcher that has seen it
        # waits out its time (or until closed) and hears the same again.
        if index == self.INDEX:
            self._closed.wait(wait_s)
        return self.INDEX, self.entries(kind)

    def close(self) -> None:
        self._closed.set()
