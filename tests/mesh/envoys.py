"""The admin APIs of a running mesh's Envoys, for tests that read what Envoy sees: the one
that holds a zone's clusters (each zone's own in the per-zone layout, the one Envoy in the
shared layout), and every Envoy for figures summed over all of them."""

from __future__ import annotations

from servemesh.launcher import Mesh
from servemesh.proxy.admin import AdminClient, ClusterView, admin_socket_path


def zone_admin(mesh: Mesh, zone: str = "zone-a") -> AdminClient:
    """The admin API of the Envoy holding `zone`'s mesh listener and clusters."""
    return AdminClient(admin_socket_path(mesh.state_dir, mesh.spec.proxy_of_zone(zone)))


def every_admin(mesh: Mesh) -> list[AdminClient]:
    """Every Envoy of the mesh, the edge's first."""
    return [AdminClient(admin_socket_path(mesh.state_dir, p)) for p in mesh.spec.proxies()]


def counters_everywhere(mesh: Mesh, prefix: str) -> dict[str, int]:
    """Envoy counters under `prefix`, summed over every Envoy of the mesh."""
    found: dict[str, int] = {}
    for admin in every_admin(mesh):
        for name, value in admin.counters(prefix).items():
            found[name] = found.get(name, 0) + value
    return found


class EveryEnvoy:
    """Every Envoy of a mesh read as one: its clusters are all of theirs (a zone's own
    clusters are named for the zone, so none hides another; the few every Envoy holds, such
    as the registry's, are read from the last)."""

    def __init__(self, mesh: Mesh) -> None:
        self.admins = every_admin(mesh)

    def clusters(self) -> dict[str, ClusterView]:
        found: dict[str, ClusterView] = {}
        for admin in self.admins:
            found.update(admin.clusters())
        return found
