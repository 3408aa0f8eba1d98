"""How the mesh is networked and reached: the zones on this machine (`network:`), the
Envoy layout (`proxy:`), certificates (`tls:`), discovery and where each part is reached
(`discovery:`), the listening ports (`ports:`), and the free ports resolving picks."""

from __future__ import annotations

import ipaddress
import os
import random
import re
import socket
import tempfile
import time
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from servemesh.spec.base import Port, _Strict
from servemesh.spec.durations import Duration


class NetworkSpec(_Strict):
    """How the zones are networked on this machine."""

    # loopback: every process shares the machine's loopback (the default).
    # netns:    each zone's gateway, feature and model processes run in a network
    #           namespace of their own (root; `servemesh up --netns`), so a partition can
    #           cut one zone off another; every address stays on loopback (NAT carries it)
    #           and Envoy's clusters for a zone send from that zone's own loopback source.
    mode: Literal["loopback", "netns"] = "loopback"


# The Envoy that holds the edge listener: the mesh's only one in the shared layout, and the
# edge's own in the per-zone layout, where each zone's Envoy is named by its zone. The name
# keeps the admin socket, config and log paths the shared layout has always had.
EDGE_PROXY = "envoy"
# The other zones' edge Envoys (proxy.edges per_zone) are named edge-<zone>.
ZONE_EDGE_PREFIX = "edge-"


def zone_edge_proxy(zone: str) -> str:
    """The name of the edge Envoy of a zone after the first (the first's is EDGE_PROXY)."""
    return f"{ZONE_EDGE_PREFIX}{zone}"


def is_edge_proxy(proxy: str) -> bool:
    """Whether one of the mesh's Envoys (spec.proxies()) holds an edge listener rather than a
    zone's mesh listener. Zone names never start with the prefix (MeshSpec checks)."""
    return proxy == EDGE_PROXY or proxy.startswith(ZONE_EDGE_PREFIX)


class ProxySpec(_Strict):
    """How the mesh's Envoy is laid out over processes (docs/architecture.md, "Zones").

    per_zone: the edge is an Envoy of its own, and each zone has its own, holding that
              zone's mesh listener and clusters; one Envoy's crash, or a config it refuses,
              takes out its own zone (or the edge), not every zone at once. The default:
              no process spans two zones.
    shared:   one Envoy holds the edge listener and every zone's mesh listener: about
              140 MiB less memory for a two-zone mesh, and one failure domain for all.
    """

    layout: Literal["shared", "per_zone"] = "per_zone"
    # per_zone: every zone has an edge Envoy of its own (the per-zone layout only), each
    #           holding the same edge listener and routes on its own port, so losing one
    #           edge loses no caller that is given every edge's address (docs/architecture.md,
    #           "Calling the mesh"). The first zone's edge is the Envoy named EDGE_PROXY.
    # one:      a single edge Envoy for every zone (about 60 MiB less; one failure domain
    #           for every caller). The shared layout always has one.
    edges: Literal["one", "per_zone"] = "per_zone"


class TlsSpec(_Strict):
    """Certificates. Every hop inside the mesh is mutual TLS with certificates from a CA
    that `servemesh up` creates under <state_dir>/tls; there is no switch for that."""

    # The edge listener serves TLS (false: plaintext, for local debugging only).
    edge: bool = True
    # More DNS names or IP addresses the edge certificate carries (besides localhost,
    # 127.0.0.1 and ::1), for callers that reach the edge by another name.
    edge_names: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list, max_length=64
    )
    # Life of each service certificate; `up` renews one with a third of its life left, and
    # `servemesh certs rotate` replaces them on a running mesh.
    leaf_days: Annotated[int, Field(ge=1, le=825)] = 30


# The name `discovery.hosts` gives the edge's Envoy by (the shared layout's only one; every
# other part is named by its instance, a zone's Envoy by proxy_part).
ENVOY_PART = "envoy"


def proxy_part(proxy: str) -> str:
    """The name of one of the mesh's Envoys (spec.proxies()) as a part of the mesh: in
    `discovery.hosts`, as a process of the launcher's, as a Prometheus instance. `envoy` for
    the edge's (the shared layout's only one), `envoy-<zone>` for a zone's."""
    return ENVOY_PART if proxy == EDGE_PROXY else f"{ENVOY_PART}-{proxy}"


class DiscoverySpec(_Strict):
    """Where Envoy finds the service instances, and where the parts listen and are reached."""

    # file:   the spec's instances at their ports (what `servemesh up` runs).
    # consul: every service registers itself in Consul with a gRPC health check over
    #         mutual TLS, and leaves on drain; `servemesh control-plane` turns the catalog's
    #         passing instances into Envoy's endpoint files (docs/multihost.md).
    # dns:    no catalog: each upstream cluster is a STRICT_DNS cluster listing host names
    #         (dns_names) that Envoy resolves itself every dns_refresh_rate_ms, every address
    #         a host; whoever owns the names (docker compose --scale, a Swarm service's
    #         tasks.<service>, a Kubernetes headless Service) adds and removes replicas.
    backend: Literal["file", "consul", "dns"] = "file"
    # The Consul agent's HTTP API, host:port (plain HTTP: run the agent beside the services).
    consul_address: Annotated[str, Field(pattern=r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")] = (
        "127.0.0.1:8500"
    )
    # A file whose first line is the Consul ACL token (null: no token).
    consul_token_file: str | None = None
    # How often Consul health-checks each instance, and how long one may fail its checks
    # before Consul removes it (a replica that died without draining).
    check_interval_s: Annotated[float, Field(ge=0.5, le=300)] = 2.0
    deregister_after: Duration = "1m"
    # The address services and Envoy bind; null: `host`. 0.0.0.0 inside a container,
    # whose peers are other containers (every port still takes mesh certificates only).
    listen_host: str | None = None
    # Where a part is reached when it is not on `host`: instance name (or "envoy") to a
    # host name or address, e.g. each container's name in docker-compose.yml.
    hosts: dict[str, Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=dict
    )
    # backend dns: the host name each instance group is looked up under, by model-server
    # pool or by service kind (registry, model, feature, gateway; a pool's entry wins over
    # its kind's). A pattern of {host} (the instance's discovery.hosts name, else host),
    # {instance}, {kind}, {pool}, {zone} and {mesh}; a kind or pool not named: "{host}".
    # Instances whose names and ports come out the same are one host of the cluster, e.g.
    # {model: "model-{zone}"} with dns_port 50051 for `docker compose up --scale`.
    dns_names: dict[str, Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=dict
    )
    # The port every name is dialled at (replicas behind one name share it); null: each
    # instance's own port (its place in `ports.services_base`).
    dns_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    # How often Envoy resolves the names again, and whether a record's TTL replaces that.
    dns_refresh_rate_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 5000
    respect_dns_ttl: bool = False
    # Which addresses a name gives: v4_only (the default: services bind IPv4, and
    # `localhost` would otherwise give ::1 too), v6_only, v4_preferred, auto (IPv6 first),
    # all (both families, every address a host).
    dns_lookup_family: Literal["v4_only", "v6_only", "v4_preferred", "auto", "all"] = "v4_only"

    @model_validator(mode="after")
    def _dns_names_are_patterns(self) -> DiscoverySpec:
        for key, pattern in self.dns_names.items():
            problem = dns_pattern_problem(pattern)
            if problem:
                raise ValueError(f"discovery.dns_names.{key}: {problem}")
        return self


# What a discovery.dns_names pattern may name, besides letters, digits, dots and dashes.
DNS_PLACEHOLDERS = ("host", "instance", "kind", "pool", "zone", "mesh")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def dns_pattern_problem(pattern: str) -> str:
    """Why `pattern` is no dns_names pattern ("" when it is one)."""
    for name in _PLACEHOLDER.findall(pattern):
        if name not in DNS_PLACEHOLDERS:
            return f"unknown placeholder {{{name}}} in {pattern!r}; known: {list(DNS_PLACEHOLDERS)}"
    literal = _PLACEHOLDER.sub("x", pattern)
    if not re.fullmatch(r"[A-Za-z0-9.\-]+", literal):
        return f"{pattern!r}: a host name takes letters, digits, dots and dashes only"
    return ""


def host_name_problem(name: str) -> str:
    """Why `name` is no host name Envoy can resolve ("" when it is one)."""
    try:
        ipaddress.ip_address(name)
        return ""
    except ValueError:
        pass
    labels = name.rstrip(".").split(".")
    if len(name) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        return f"{name!r} is not a host name (dot-separated labels of 1-63 letters, digits, dashes)"
    return ""


class Ports(_Strict):
    """Fixed listening ports; 0 picks a free port at start (what the tests use)."""

    edge: Port = 8080
    # The edges of the zones after the first (proxy.edges per_zone): zone i (i >= 1)
    # listens on zone_edges + i - 1.
    zone_edges: Port = 8180
    # The first zone's mesh listener; zone i listens on mesh + i.
    mesh: Port = 8081
    # Kept so older spec files still load; used only as Envoy's --base-id. Envoy's admin API
    # listens on no TCP port: it is the Unix socket <state_dir>/admin/envoy.sock, in a
    # directory of mode 0700 (servemesh.proxy.admin.admin_socket_path).
    envoy_admin: Port = 9901
    # Services take consecutive ports from here, in the order `instances()` lists them.
    services_base: Port = 50051
    # Envoy's stats as Prometheus text (GET /stats/prometheus, loopback; nothing else of
    # the admin API is reachable there).
    envoy_stats: Port = 9902
    # The mesh's Prometheus (metrics.prometheus); 9090, Prometheus's own default, is left
    # to a Prometheus of the machine's.
    prometheus: Port = 9190

    @classmethod
    def free(cls) -> Ports:
        """Every port picked free at start: a mesh that runs beside others (tests, drills,
        benchmarks)."""
        return cls(edge=0, zone_edges=0, mesh=0, envoy_admin=0, services_base=0)

    @model_validator(mode="before")
    @classmethod
    def _free_with_the_edge(cls, data: object) -> object:
        # A mesh on free ports (edge: 0, as tests and drills run several at once) gets free
        # metrics ports too, unless it names them.
        if isinstance(data, dict) and data.get("edge") == 0:
            data = {"envoy_stats": 0, "prometheus": 0, "zone_edges": 0, **data}
        return data


# Where free_port looks first: the ports just below the kernel's ephemeral range.
_LISTEN_SPAN = 20000
# How long a port free_port picked stays claimed: its service binds it within seconds (an
# Envoy, after every service it fronts is ready: well under a minute on a busy machine).
# Short, because a test run resolves thousands of ports.
RESERVATION_S = 120.0
# Expired claims are swept at most this often by each process.
_SWEEP_EVERY_S = 30.0
_last_sweep = [0.0]


def _claims_folder() -> Path:
    folder = Path(tempfile.gettempdir()) / f"servemesh-ports-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _sweep(folder: Path) -> None:
    """Remove the expired claims (left by every caller: none removes its own)."""
    now = time.time()
    if now - _last_sweep[0] < _SWEEP_EVERY_S:
        return
    _last_sweep[0] = now
    for claim in folder.iterdir():
        try:
            if now - claim.stat().st_mtime >= RESERVATION_S:
                claim.unlink(missing_ok=True)
        except OSError:
            continue


_PICKER = random.Random()  # seeded from the OS: two processes never walk the same ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _reserve(port: int) -> bool:
    """Claim `port` for this machine's next RESERVATION_S: false when another caller of
    free_port (any process of this user) holds it. A claim older than that has been bound
    by its service long since, or was never used: it is taken over."""
    folder = _claims_folder()
    _sweep(folder)
    claim = folder / str(port)
    for _ in range(2):
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            try:
                age = time.time() - claim.stat().st_mtime
            except FileNotFoundError:
                continue  # released meanwhile: try again
            if age < RESERVATION_S:
                return False
            claim.unlink(missing_ok=True)
            continue
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        return True
    return False


def free_port(host: str) -> int:
    """A port nobody listens on now, for a service that binds it later.

    Taken below the kernel's ephemeral range when there is room: the kernel hands ports of
    that range to every outgoing connection and every bind to port 0, so a port picked there
    could be taken by one of those before its service binds it (seen with two meshes
    starting side by side). Below it, only another caller of this function could take it:
    each port picked is claimed in a folder of the user's for RESERVATION_S, so two meshes
    resolving at once (two test workers, a benchmark beside the suite) never pick the same
    one in the seconds before their services bind (seen: an Envoy's listener taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    start = max(1024, low - _LISTEN_SPAN)
    for _ in range(256 if low - start >= 1024 else 0):
        port = _PICKER.randrange(start, low)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        if _reserve(port):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
