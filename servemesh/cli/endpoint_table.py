"""The table of a running mesh's endpoints: what `servemesh up` prints once the mesh is
up, and what `servemesh status` prints again later, from any shell (with each process's
state and health beside it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from servemesh.spec import EDGE_PROXY, ResolvedSpec, proxy_part, registry_mirror_name


@dataclass(frozen=True)
class Endpoint:
    """One row: what it is, where it answers, and the process behind it (the mesh's name
    for it, "" when the row is no process of its own: an admin socket, a shared Envoy's
    second listener)."""

    what: str
    address: str
    process: str = ""
    # The Envoy whose admin socket says whether this row's Envoy is ready ("" for none).
    proxy: str = ""
    # A service instance answering grpc.health.v1 on its own port ("" for none).
    instance: str = ""


def endpoint_rows(spec: ResolvedSpec, endpoints: Mapping[str, Any]) -> list[Endpoint]:
    """Every endpoint of the mesh `spec` resolves to, as `up` lists them."""
    rows = [Endpoint("edge (clients, grpcurl)", str(endpoints["edge"]), "envoy", EDGE_PROXY)]
    for proxy in spec.edge_proxies()[1:]:
        # The other zones' edges: a caller is given every edge's address.
        what = f"edge of {spec.zone_of_edge(proxy)} (clients)"
        rows.append(Endpoint(what, spec.edge_address_of(proxy), proxy_part(proxy), proxy))
    per_zone = spec.proxy.layout == "per_zone"
    for zone in spec.zones:
        # Its own Envoy in the per-zone layout; the edge's holds it in the shared one.
        process, proxy = (proxy_part(zone), zone) if per_zone else ("", "")
        rows.append(
            Endpoint(f"mesh listener of {zone}", spec.mesh_address_for(zone), process, proxy)
        )
    # A Unix socket (curl --unix-socket PATH http://localhost/...), not a TCP port.
    for proxy, socket in dict(endpoints["envoy_admins"]).items():
        what = "envoy admin" if proxy == EDGE_PROXY else f"envoy admin of {proxy}"
        rows.append(Endpoint(what, f"unix:{socket}"))
    for zone in spec.registry_mirror_zones():
        # A zone's read-only mirror of the registry (registry.mirrors).
        name = registry_mirror_name(zone)
        address = spec.registry_mirror_address(zone)
        rows.append(Endpoint(f"registry mirror of {zone}", str(address), name))
    rows.append(Endpoint("redis", str(endpoints["redis"]), "redis"))
    for name, port in spec.store_ports.items():
        # A replicated store's replicas and Sentinels (feature_store.topology).
        kind, _, where = name.partition("-")
        what = f"redis {kind} of {where}" if where != "witness" else "redis sentinel (witness)"
        rows.append(Endpoint(what, f"{spec.host}:{port}", f"redis-{name}"))
    if endpoints.get("trace_store"):
        # `servemesh trace` reads what it stores; a collector of the spec's when no pid.
        rows.append(Endpoint("trace store (OTLP)", str(endpoints["trace_store"]), "tracestore"))
    if endpoints.get("alertmanager"):
        # Beside the mesh's Prometheus; `servemesh alerts` reads both.
        rows.append(Endpoint("alertmanager", f"http://{endpoints['alertmanager']}", "alertmanager"))
        receiver = f"http://{endpoints['alert_receiver']}"
        rows.append(Endpoint("alert receiver (webhook)", receiver, "alert-receiver"))
    for inst in spec.instances():
        rows.append(Endpoint(inst.name, spec.address_of(inst.name), inst.name, instance=inst.name))
    return rows


def endpoint_table(
    title: str,
    rows: Sequence[Endpoint],
    pids: Mapping[str, int],
    extra: Mapping[str, Mapping[str, str]] | None = None,
) -> Table:
    """The rows with their PIDs; `extra` adds a column per key, by row (`what`)."""
    table = Table(title=title, title_justify="left")
    table.add_column("endpoint")
    table.add_column("address")
    table.add_column("pid", justify="right")
    columns = dict(extra or {})
    for name in columns:
        table.add_column(name)
    for row in rows:
        pid = pids.get(row.process, "") if row.process else ""
        cells = [columns[name].get(row.what, "") for name in columns]
        table.add_row(row.what, row.address, str(pid), *cells)
    return table
