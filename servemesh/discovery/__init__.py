"""Service discovery: where the mesh's instances are, and Envoy's endpoints made from it.

A `Catalog` lists the instances of each service kind. Two stand behind it: the file
catalog (the resolved spec's own instances and ports: what `servemesh up` runs) and
Consul, where every service registers itself with a gRPC health check over mutual TLS
(`registration`) when the spec's `discovery.backend` is `consul`. The control plane
(`control_plane`) watches a catalog and writes Envoy's endpoint files from it
(`endpoints`); `compose` renders what docker-compose.yml mounts.
"""

from __future__ import annotations

from servemesh.discovery.catalog import Catalog, CatalogEntry, FileCatalog
from servemesh.discovery.endpoints import endpoint_files, write_endpoint_files

__all__ = ["Catalog", "CatalogEntry", "FileCatalog", "endpoint_files", "write_endpoint_files"]
