"""Consul as the catalog: what a service registers (and how Consul checks it), and the
control plane's blocking queries of the passing instances of each service kind.

The registration names the service by its kind (gateway, feature, model, registry), the
instance by `<mesh>-<instance>`, with the instance's address and port, its zone and mesh
as tags and meta (a model server also lists the versions it serves), and one check: Consul
calls grpc.health.v1.Health/Check on the instance's port over TLS, verifies the instance's
certificate against the mesh CA under the instance's own name, and presents a mesh
certificate of its own (the agent's `enable_agent_tls_for_checks`): every service port
takes mesh certificates only. An instance whose check fails `deregister_after` long is
removed by Consul; one that drains deregisters itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import consul

from servemesh.catalog.file import CatalogEntry
from servemesh.identity.authority import dns_name
from servemesh.spec import ResolvedSpec, ServiceKind, SpecError

log = logging.getLogger(__name__)

# Meta keys (Consul allows letters, digits, - and _ only).
META_MESH = "mesh"
META_INSTANCE = "instance"
META_ZONE = "zone"
META_VERSIONS = "versions"
# Consul keeps at most 512 characters per meta value.
META_VALUE_MAX = 512


# The environment variable naming the token file when the spec names none (Consul's own
# CLI reads the same one).
TOKEN_FILE_ENV = "CONSUL_HTTP_TOKEN_FILE"


def consul_token(spec: ResolvedSpec, environ: Mapping[str, str] = os.environ) -> str | None:
    """The ACL token in the file the spec's `discovery.consul_token_file` names, else the
    one `CONSUL_HTTP_TOKEN_FILE` names; None when neither names one (or the file is
    empty). The token itself is never logged nor put in an error."""
    path = spec.discovery.consul_token_file or environ.get(TOKEN_FILE_ENV) or None
    if path is None:
        return None
    try:
        return Path(path).read_text().strip() or None
    except FileNotFoundError:
        field = (
            "discovery.consul_token_file" if spec.discovery.consul_token_file else TOKEN_FILE_ENV
        )
        raise SpecError(f"{field}: no such file: {path}") from None


def consul_client(spec: ResolvedSpec) -> consul.Consul:
    """A client of the spec's Consul agent, with its ACL token when one is named."""
    host, _, port = spec.discovery.consul_address.rpartition(":")
    return consul.Consul(host=host.strip("[]"), port=int(port), token=consul_token(spec))


def service_id(spec: ResolvedSpec, instance: str) -> str:
    """The instance's id in Consul: unique across the meshes one agent may hold."""
    return f"{spec.name}-{instance}"


def served_versions(spec: ResolvedSpec) -> str:
    """model:version,... for every version a model server hosts, within Consul's limit."""
    names = [f"{m}:{v}" for m, model in sorted(spec.models.items()) for v in sorted(model.versions)]
    text = ",".join(names)
    return text if len(text) <= META_VALUE_MAX else text[: META_VALUE_MAX - 3] + "..."


def health_check(spec: ResolvedSpec, instance: str, address: str) -> dict[str, Any]:
    """Consul's gRPC check of an instance: TLS, the certificate verified under its name."""
    settings = spec.discovery
    interval = f"{round(settings.check_interval_s * 1000)}ms"
    check: dict[str, Any] = consul.Check.grpc(
        f"{address}:{spec.port_of(instance)}",
        interval,
        use_tls=True,
        tls_skip_verify=False,
        timeout=f"{round(min(settings.check_interval_s, 5.0) * 1000)}ms",
        deregister=settings.deregister_after,
    )
    # py-consul's helper has no parameter for it: the name the certificate must carry (the
    # address is an IP, which the mesh's certificates do not name).
    check["TLSServerName"] = dns_name(instance, spec.name)
    check["Name"] = f"{instance} gRPC health (mutual TLS)"
    return check


def service_registration(spec: ResolvedSpec, instance: str, address: str) -> dict[str, Any]:
    """The keyword arguments of `agent.service.register` for `instance` at `address`."""
    inst = spec.instance(instance)
    meta = {META_MESH: spec.name, META_INSTANCE: instance, META_ZONE: inst.zone}
    if inst.service == "model":
        meta[META_VERSIONS] = served_versions(spec)
    return {
        "name": inst.service,
        "service_id": service_id(spec, instance),
        "address": address,
        "port": spec.port_of(instance),
        "tags": [inst.zone, f"{META_MESH}={spec.name}"],
        "meta": meta,
        "check": health_check(spec, instance, address),
    }


def entries_of(
    spec: ResolvedSpec, kind: ServiceKind, nodes: list[dict[str, Any]]
) -> list[CatalogEntry]:
    """The catalog entries of the spec's mesh in an answer of /v1/health/service/<kind>."""
    found = []
    for node in nodes:
        service = node.get("Service") or {}
        meta = service.get("Meta") or {}
        if meta.get(META_MESH) != spec.name:
            continue  # another mesh's instance of the same kind
        address = service.get("Address") or (node.get("Node") or {}).get("Address")
        port = service.get("Port")
        if not address or not isinstance(port, int) or not port:
            log.warning("consul: %s has no address or port; skipped", service.get("ID"))
            continue
        checks = node.get("Checks") or []
        found.append(
            CatalogEntry(
                kind,
                meta.get(META_INSTANCE) or str(service.get("ID")),
                meta.get(META_ZONE) or "",
                str(address),
                port,
                passing=all(check.get("Status") == "passing" for check in checks),
            )
        )
    return found


class ConsulCatalog:
    """The catalog in a Consul agent: blocking queries of /v1/health/service/<kind>."""

    def __init__(self, spec: ResolvedSpec, client: consul.Consul | None = None) -> None:
        self.spec = spec
        self.client = client or consul_client(spec)

    def watch(self, kind: ServiceKind, index: int, wait_s: float) -> tuple[int, list[CatalogEntry]]:
        index_text, nodes = self.client.health.service(
            kind, index=str(index) if index else None, wait=f"{max(1, round(wait_s))}s"
        )
        return int(index_text), entries_of(self.spec, kind, nodes)

    def close(self) -> None:
        # A blocking query cannot be cut short; its watcher thread is a daemon, and ends
        # with its answer (at most wait_s later).
        self.client.http.session.close()

    def register(self, instance: str, address: str) -> None:
        self.client.agent.service.register(**service_registration(self.spec, instance, address))

    def deregister(self, instance: str) -> None:
        self.client.agent.service.deregister(service_id(self.spec, instance))
