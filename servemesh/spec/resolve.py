"""A running mesh's spec (`ResolvedSpec`: every listening port concrete), how a declared
spec is resolved, compared and moved between profiles, and how specs are parsed, loaded
and written."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from servemesh.contract.yaml_text import dump_yaml, load_yaml
from servemesh.spec.base import Port, ScaledKind, SpecError, ZoneName
from servemesh.spec.features import REDIS_PASSWORD_FILE, sentinel_names
from servemesh.spec.fleet import (
    REGISTRY_INSTANCE,
    REGISTRY_MIRROR_PREFIX,
    FleetState,
    Instance,
    Replicas,
    model_set_instances,
    registry_mirror_name,
)
from servemesh.spec.mesh import MeshSpec, Profile, Spec
from servemesh.spec.models import SHARED_POOL
from servemesh.spec.network import EDGE_PROXY, ENVOY_PART, Ports, free_port, proxy_part
from servemesh.spec.observability import TRACE_STORE_PART


class ResolvedSpec(MeshSpec):
    """A spec whose every listening port is concrete: what a running mesh is.

    `resolve` makes one from a declared MeshSpec; the launcher writes it for the service
    processes, which read it with `load_resolved`. Only here can an address be asked for,
    so a tool that forgets to resolve first fails the type check, not a run.
    """

    # Each zone's mesh listener port (ports.mesh + zone index when fixed).
    mesh_ports: dict[ZoneName, Port]
    # The port of every service instance, by instance name.
    instance_ports: dict[str, Port]
    # The Prometheus /metrics side port of every service instance, by instance name.
    metrics_ports: dict[str, Port]
    # Each zone Envoy's stats listener port, in the per-zone layout (the edge Envoy's is
    # ports.envoy_stats, zone i's envoy_stats + 1 + i unless it is free); empty in the shared
    # layout.
    zone_stats_ports: dict[ZoneName, Port] = Field(default_factory=dict)
    # The edge listener and stats listener ports of every edge Envoy but the first (whose
    # are ports.edge and ports.envoy_stats), by Envoy name (edge-<zone>); empty with one
    # edge.
    edge_ports: dict[str, Port] = Field(default_factory=dict)
    edge_stats_ports: dict[str, Port] = Field(default_factory=dict)
    # Each zone's registry mirror's port (registry.mirrors), by zone; empty without mirrors.
    registry_mirror_ports: dict[ZoneName, Port] = Field(default_factory=dict)
    # The port of the Redis the launcher runs itself; None when the spec names its own
    # (feature_store.redis_url is set either way).
    embedded_redis_port: Port | None = None
    # A replicated store's (feature_store.topology): each zone's replica and Sentinel
    # ports, by "replica-<zone>" and "sentinel-<zone>"; empty for a single Redis.
    store_ports: dict[str, Port] = Field(default_factory=dict)
    # The port of the trace store the launcher runs itself; None when the spec names an
    # OTLP collector of its own, or tracing is off (tracing.otlp_endpoint is set when on).
    embedded_trace_store_port: Port | None = None
    # How the model servers are arranged right now (blue-green and rolling updates change
    # it live; `servemesh up` starts and stops replicas to match). Never in a spec file.
    fleet: FleetState = Field(default_factory=lambda: FleetState())

    @model_validator(mode="after")
    def _fleet_names_what_runs(self) -> ResolvedSpec:
        names = [i.name for i in self.instances()]
        twice = sorted(n for n, count in Counter(names).items() if count > 1)
        if twice:
            raise ValueError(f"fleet.sets: instance names collide: {twice}")
        models = {i.name for i in self.instances() if i.service == "model"}
        scaled = {i.name for i in self.instances() if i.service != "registry"}
        for field_name, listed, known in (
            ("draining", self.fleet.draining, scaled),
            ("standby", self.fleet.standby, scaled),
            ("generations", list(self.fleet.generations), models),
        ):
            unknown = sorted(set(listed) - known)
            if unknown:
                kind = "model server" if known is models else "replica"
                raise ValueError(f"fleet.{field_name}: names no {kind}: {unknown}")
        pools = self.pool_names()
        unknown_homes = sorted(set(self.fleet.homes) - set(pools))
        if unknown_homes:
            raise ValueError(f"fleet.homes: no such pools {unknown_homes}; pools: {pools}")
        for index, replica_set in enumerate(self.fleet.sets):
            unknown_pools = sorted(set(replica_set.pools or ()) - set(pools))
            if unknown_pools:
                raise ValueError(
                    f"fleet.sets[{index}].pools: no such pools {unknown_pools}; pools: {pools}"
                )
            for model, versions in replica_set.serves.items():
                where = f"fleet.sets[{index}].serves.{model}"
                if model not in self.models:
                    raise ValueError(f"{where}: no such model; models: {sorted(self.models)}")
                unknown = sorted(set(versions) - set(self.models[model].versions))
                if unknown:
                    raise ValueError(f"{where}: no such versions {unknown}")
                if replica_set.pools is not None and self.pool_of(model) not in replica_set.pools:
                    raise ValueError(
                        f"{where}: the model's pool {self.pool_of(model)!r} is not one of the "
                        f"set's pools {replica_set.pools}"
                    )
        return self

    def _model_instances(self) -> list[Instance]:
        """The first set's replicas, each pool under its home name, then every other set's
        in its own pools."""
        found: list[Instance] = []
        for pool in self.pool_names():
            found += model_set_instances(
                self.fleet.home_of(pool), self.zones, self.pool_replicas(pool), pool
            )
        for replica_set in self.fleet.sets[1:]:
            for pool in self.pool_names():
                if replica_set.pools is None or pool in replica_set.pools:
                    found += model_set_instances(
                        replica_set.name, self.zones, self.pool_replicas(pool), pool
                    )
        return found

    def pool_replicas(self, pool: str) -> Replicas:
        """Model servers per zone of a pool as they run: the scaler's counts, else the
        spec's."""
        counts = self.fleet.model_pools.get(pool)
        if counts is None:
            return super().pool_replicas(pool)
        return Replicas.model_construct(per_zone=dict(counts))

    def replicas_of(self, kind: ScaledKind, pool: str = SHARED_POOL) -> Replicas:
        """Replicas per zone of a kind (model servers: of `pool`) as they run: the
        scaler's counts, else the spec's."""
        if kind == "model":
            return self.pool_replicas(pool)
        counts = self.fleet.pools.get(kind)
        if counts is None:
            return self.declared_replicas(kind)
        return Replicas.model_construct(per_zone=dict(counts))

    def replica_set_of(self, model: str, version: str) -> str:
        """The name of the set whose replicas a version's clusters list: a set of the
        model's pool that serves it, else the first (under the pool's home name)."""
        pool = self.pool_of(model)
        for replica_set in self.fleet.sets_in(pool):
            if version in replica_set.serves.get(model, []):
                return replica_set.name
        return self.fleet.home_of(pool)

    def set_replicas(self, set_name: str, pool: str | None = None) -> list[Instance]:
        """The model servers of one set (of one pool: sets of different pools may share a
        name), in start order."""
        return [
            i
            for i in self.instances()
            if i.service == "model"
            and i.replica_set == set_name
            and (pool is None or i.pool == pool)
        ]

    def first_set_replicas(self) -> list[Instance]:
        """The first set's model servers, every pool's under its home name."""
        return [
            i
            for i in self.instances()
            if i.service == "model" and i.replica_set == self.fleet.home_of(i.pool)
        ]

    def version_replicas(self, model: str, version: str) -> list[Instance]:
        """The model servers a version's clusters list as endpoints: its pool's, in the set
        that serves it."""
        pool = self.pool_of(model)
        return self.set_replicas(self.replica_set_of(model, version), pool)

    @model_validator(mode="after")
    def _every_listener_has_a_port(self) -> ResolvedSpec:
        missing = [i.name for i in self.instances() if not self.instance_ports.get(i.name)]
        if not self.feature_store.redis_url:
            missing.append("feature_store.redis_url")
        missing += [f"mesh listener of {z}" for z in self.zones if not self.mesh_ports.get(z)]
        if self.ports.edge == 0 or self.ports.envoy_admin == 0:
            missing.append("ports.edge or ports.envoy_admin")
        for proxy in self.edge_proxies()[1:]:
            if not self.edge_ports.get(proxy) or not self.edge_stats_ports.get(proxy):
                missing.append(f"edge and stats listeners of {proxy}")
        missing += [
            f"registry mirror of {zone}"
            for zone in self.registry_mirror_zones()
            if not self.registry_mirror_ports.get(zone)
        ]
        missing += [
            f"metrics of {i.name}" for i in self.instances() if not self.metrics_ports.get(i.name)
        ]
        if self.ports.envoy_stats == 0 or self.ports.prometheus == 0:
            missing.append("ports.envoy_stats or ports.prometheus")
        if missing:
            raise ValueError(f"a resolved spec needs a port for: {', '.join(missing)}")
        return self

    @property
    def redis_url(self) -> str:
        """The online store every feature service reads (always set once resolved)."""
        assert self.feature_store.redis_url, "validated when the spec was resolved"
        return self.feature_store.redis_url

    def store_replica(self, zone: str) -> tuple[str, int] | None:
        """Host and port of `zone`'s replica of a replicated store (None: single)."""
        port = self.store_ports.get(f"replica-{zone}")
        return (self.host, port) if port else None

    @property
    def sentinel_ports(self) -> dict[str, int]:
        """The port of each Sentinel of a replicated store, by name: zone by zone, then the
        witness where the mesh resolved one; empty for a single store."""
        names = sentinel_names(self.zones, witness=True)
        return {name: self.store_ports[name] for name in names if self.store_ports.get(name)}

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        """Host and port of every Sentinel of a replicated store (`sentinel_ports`' order)."""
        return [(self.host, port) for port in self.sentinel_ports.values()]

    def redis_password(self) -> str | None:
        """The Redis password from feature_store.password_file (None: no file named). Read
        at each call: clients pass it to redis-py, it never joins the URL."""
        path = self.feature_store.password_file
        if path is None:
            return None
        try:
            return Path(path).read_text().strip() or None
        except FileNotFoundError:
            raise SpecError("feature_store.password_file: no such file") from None

    def port_of(self, instance_name: str) -> int:
        try:
            return self.instance_ports[instance_name]
        except KeyError:
            raise SpecError(f"no instance named {instance_name!r}") from None

    def serving_port_of(self, process: str) -> int:
        """The gRPC port of one of the mesh's serving processes: an instance, or a zone's
        registry mirror (which no catalog lists: no caller but its zone's model servers)."""
        zone = process.removeprefix(REGISTRY_MIRROR_PREFIX)
        if process != zone and zone in self.registry_mirror_ports:
            return self.registry_mirror_ports[zone]
        return self.port_of(process)

    def host_of(self, part: str) -> str:
        """Where an instance (or an Envoy, proxy_part) is reached: discovery.hosts, else
        host."""
        return self.discovery.hosts.get(part, self.host)

    def endpoint_of(self, instance_name: str) -> tuple[str, int]:
        """Where Envoy's clusters list an instance: its address and port, or with
        `discovery.backend: dns` the host name Envoy resolves (dns_names) and dns_port, else
        its own port. Instances of one name and port are one host of a cluster."""
        if self.discovery.backend != "dns":
            return self.host_of(instance_name), self.port_of(instance_name)
        name = self.dns_name_of(self.instance(instance_name))
        return name, self.discovery.dns_port or self.port_of(instance_name)

    @property
    def listen_host(self) -> str:
        """The address services and Envoy bind: discovery.listen_host, else host."""
        return self.discovery.listen_host or self.host

    def address_of(self, instance_name: str) -> str:
        return f"{self.host_of(instance_name)}:{self.port_of(instance_name)}"

    def metrics_address_of(self, instance_name: str) -> str:
        """host:port of an instance's Prometheus /metrics endpoint."""
        port = self.metrics_ports.get(instance_name)
        if not port:
            raise SpecError(f"no instance named {instance_name!r}: it has no metrics port")
        return f"{self.host_of(instance_name)}:{port}"

    @property
    def envoy_stats_address(self) -> str:
        """host:port of Envoy's stats listener (GET /stats/prometheus); in the per-zone
        layout, the edge Envoy's."""
        return f"{self.host_of(ENVOY_PART)}:{self.ports.envoy_stats}"

    def proxy_stats_port(self, proxy: str) -> int:
        """The stats listener's port of one of the mesh's Envoys."""
        if proxy == EDGE_PROXY:
            return self.ports.envoy_stats
        if proxy in self.edge_stats_ports:
            return self.edge_stats_ports[proxy]
        try:
            return self.zone_stats_ports[proxy]
        except KeyError:
            raise SpecError(f"no Envoy named {proxy!r}; Envoys: {self.proxies()}") from None

    def proxy_stats_address(self, proxy: str) -> str:
        return f"{self.host_of(proxy_part(proxy))}:{self.proxy_stats_port(proxy)}"

    @property
    def prometheus_address(self) -> str:
        """host:port of the mesh's Prometheus (when metrics.prometheus started one)."""
        return f"{self.host}:{self.ports.prometheus}"

    @property
    def mesh_address(self) -> str:
        """Envoy's mesh listener of the first zone (for tools outside any zone)."""
        return self.mesh_address_for(self.zones[0])

    def mesh_address_for(self, zone: str) -> str:
        """Where services of `zone` reach each other: that zone's Envoy mesh listener, whose
        clusters prefer endpoints in the same zone and fail over to the others."""
        try:
            port = self.mesh_ports[zone]
        except KeyError:
            raise SpecError(f"no zone named {zone!r}; zones: {self.zones}") from None
        return f"{self.host_of(proxy_part(self.proxy_of_zone(zone)))}:{port}"

    @property
    def edge_address(self) -> str:
        """The first zone's edge (the only one with proxy.edges one)."""
        return f"{self.host_of(ENVOY_PART)}:{self.ports.edge}"

    def edge_port_of(self, proxy: str) -> int:
        """The edge listener's port of one of the mesh's edge Envoys (edge_proxies)."""
        if proxy == EDGE_PROXY:
            return self.ports.edge
        try:
            return self.edge_ports[proxy]
        except KeyError:
            raise SpecError(
                f"no edge Envoy named {proxy!r}; edges: {self.edge_proxies()}"
            ) from None

    def edge_address_of(self, proxy: str) -> str:
        return f"{self.host_of(proxy_part(proxy))}:{self.edge_port_of(proxy)}"

    @property
    def edge_addresses(self) -> list[str]:
        """Every edge's address, the first zone's first: what a caller is given."""
        return [self.edge_address_of(proxy) for proxy in self.edge_proxies()]

    @property
    def registry_instance(self) -> str:
        return REGISTRY_INSTANCE

    @property
    def registry_address(self) -> str:
        return self.address_of(REGISTRY_INSTANCE)

    def registry_mirror_address(self, zone: str) -> str | None:
        """host:port of `zone`'s registry mirror (None: the zone has none)."""
        port = self.registry_mirror_ports.get(zone)
        return f"{self.host_of(registry_mirror_name(zone))}:{port}" if port else None


# What a resolved spec has and a declared one does not.
RESOLVED_FIELDS = {
    "fleet",
    "mesh_ports",
    "zone_stats_ports",
    "edge_ports",
    "edge_stats_ports",
    "registry_mirror_ports",
    "instance_ports",
    "metrics_ports",
    "embedded_redis_port",
    "store_ports",
    "embedded_trace_store_port",
}


def with_profile(spec: Spec, profile: Profile) -> Spec:
    """`spec` moved to `profile`: its feature and model processes and its Envoy layout as the
    profile presets them (what `servemesh bench layout` compares); the rest as it was. A
    declared spec only: a running mesh's (ResolvedSpec) has ports for the processes it runs."""
    if isinstance(spec, ResolvedSpec):
        raise TypeError("with_profile takes a declared spec, not a running mesh's")
    data = spec.model_dump(mode="json")
    for section in ("feature", "model_servers", "proxy"):
        data.pop(section)
    return type(spec).model_validate({**data, "profile": profile})


def resolve(spec: MeshSpec) -> ResolvedSpec:
    """The spec with every listening port concrete (0 becomes a free port). A spec that is
    already resolved keeps its ports."""
    known = spec if isinstance(spec, ResolvedSpec) else None
    taken: set[int] = set()
    # Every port the running mesh holds: an instance new to it (a replica set a blue-green
    # update adds) must not take one that an instance later in the order keeps.
    held: set[int] = set()
    if known is not None:
        held = {*known.instance_ports.values(), *known.metrics_ports.values()}

    def pick(port: int, *, fresh: bool = False) -> int:
        while port == 0 or port in taken or (fresh and port in held):
            port = free_port(spec.host)
        taken.add(port)
        return port

    mesh_ports = {
        zone: pick(
            known.mesh_ports[zone] if known else (spec.ports.mesh + i if spec.ports.mesh else 0)
        )
        for i, zone in enumerate(spec.zones)
    }
    ports = Ports(
        edge=pick(spec.ports.edge),
        zone_edges=spec.ports.zone_edges,
        mesh=mesh_ports[spec.zones[0]],
        envoy_admin=pick(spec.ports.envoy_admin),
        services_base=spec.ports.services_base,
        envoy_stats=pick(spec.ports.envoy_stats),
        prometheus=pick(spec.ports.prometheus),
    )
    instance_ports = {}
    for offset, inst in enumerate(spec.instances()):
        wanted = spec.ports.services_base + offset if spec.ports.services_base else 0
        if known is None:
            instance_ports[inst.name] = pick(wanted)
        else:
            kept = known.instance_ports.get(inst.name, 0)
            instance_ports[inst.name] = pick(kept, fresh=not kept)
    # Model servers first, as when they alone had a metrics port; a resolved spec (even one
    # written before the other services had one) keeps the ports it has.
    by_kind = sorted(spec.instances(), key=lambda inst: inst.service != "model")
    metrics_ports = {}
    for inst in by_kind:
        kept = known.metrics_ports.get(inst.name, 0) if known else 0
        metrics_ports[inst.name] = pick(kept, fresh=known is not None and not kept)

    # The zone Envoys' stats listeners (per-zone layout): kept when resolved, else the
    # ports after the edge Envoy's (zone i: envoy_stats + 1 + i), free when that one is.
    def zone_stats_port(index: int, zone: str) -> int:
        if known is not None:
            return known.zone_stats_ports.get(zone, 0)
        return spec.ports.envoy_stats + 1 + index if spec.ports.envoy_stats else 0

    zone_stats_ports = {
        zone: pick(zone_stats_port(i, zone))
        for i, zone in enumerate(spec.zones if spec.proxy.layout == "per_zone" else [])
    }
    # The other zones' edges: their edge listeners from ports.zone_edges, their stats
    # listeners after the zone Envoys'; kept when resolved, free when the base is 0.
    edge_ports: dict[str, int] = {}
    edge_stats_ports: dict[str, int] = {}
    zone_count = len(zone_stats_ports)
    for index, proxy in enumerate(spec.edge_proxies()[1:]):
        if known is not None:
            wanted_edge = known.edge_ports.get(proxy, 0)
            wanted_stats = known.edge_stats_ports.get(proxy, 0)
        else:
            wanted_edge = spec.ports.zone_edges + index if spec.ports.zone_edges else 0
            stats_base = spec.ports.envoy_stats
            wanted_stats = stats_base + 1 + zone_count + index if stats_base else 0
        edge_ports[proxy] = pick(wanted_edge)
        edge_stats_ports[proxy] = pick(wanted_stats)
    # The zones' registry mirrors: kept when resolved, else the ports after the trace
    # store's (services_base + instances + 1 + i: a container's health check can name it),
    # free when the base is 0.
    base = spec.ports.services_base
    after_services = base + len(spec.instances()) + 1 if base else 0
    registry_mirror_ports = {
        zone: pick(
            known.registry_mirror_ports.get(zone, 0)
            if known
            else (after_services + i if after_services else 0)
        )
        for i, zone in enumerate(spec.registry_mirror_zones())
    }
    # No Redis named: the launcher runs one, on a port chosen now with the others.
    embedded_redis_port = known.embedded_redis_port if known else None
    store = spec.feature_store
    if not store.redis_url:
        embedded_redis_port = pick(0)
        store = store.model_copy(
            update={
                "redis_url": f"redis://{spec.host}:{embedded_redis_port}/0",
                "password_file": str(Path(spec.state_dir) / REDIS_PASSWORD_FILE),
            }
        )
    store_ports = dict(known.store_ports) if known else {}
    if store.topology == "replicated" and not store_ports:
        if embedded_redis_port is None:
            raise ValueError(
                "feature_store.topology: replicated needs the launcher's own Redis "
                "(feature_store.redis_url: null)"
            )
        for zone in spec.zones:
            store_ports[f"replica-{zone}"] = pick(0)
        for name in sentinel_names(spec.zones, store.witness_sentinel):
            store_ports[name] = pick(0)
    # No collector named: the launcher runs the embedded trace store, on a port chosen now.
    tracing = spec.tracing
    embedded_trace_store_port = known.embedded_trace_store_port if known else None
    if tracing.enabled and not tracing.otlp_endpoint:
        # The port after the services' (Envoy's rendered config names it), else a free one.
        base = spec.ports.services_base
        embedded_trace_store_port = pick(
            known.embedded_trace_store_port
            if known and known.embedded_trace_store_port
            else (base + len(spec.instances()) if base else 0)
        )
        # Reached where discovery places it (a container of its own in compose), else on
        # the mesh's host.
        store_host = spec.discovery.hosts.get(TRACE_STORE_PART, spec.host)
        tracing = tracing.model_copy(
            update={"otlp_endpoint": f"{store_host}:{embedded_trace_store_port}"}
        )
    fields = spec.model_dump(exclude=RESOLVED_FIELDS)
    return ResolvedSpec.model_validate(
        {
            **fields,
            "feature_store": store.model_dump(),
            "embedded_redis_port": embedded_redis_port,
            "store_ports": store_ports,
            "tracing": tracing.model_dump(),
            "embedded_trace_store_port": embedded_trace_store_port,
            # The running arrangement of model servers (a declared spec has none).
            "fleet": known.fleet.model_dump() if known else FleetState().model_dump(),
            "ports": ports.model_dump(),
            "mesh_ports": mesh_ports,
            "zone_stats_ports": zone_stats_ports,
            "edge_ports": edge_ports,
            "edge_stats_ports": edge_stats_ports,
            "registry_mirror_ports": registry_mirror_ports,
            "instance_ports": instance_ports,
            "metrics_ports": metrics_ports,
        }
    )


def declared(spec: MeshSpec) -> MeshSpec:
    """The declared part of a spec (a resolved spec without its ports), e.g. to compare
    a running mesh's spec with a file."""
    if not isinstance(spec, ResolvedSpec):
        return spec
    fields = spec.model_dump(exclude=RESOLVED_FIELDS)
    if spec.embedded_redis_port is not None:
        fields["feature_store"]["redis_url"] = None  # the launcher's own, not declared
        fields["feature_store"]["password_file"] = None
    if spec.embedded_trace_store_port is not None:
        fields["tracing"]["otlp_endpoint"] = None  # the launcher's own store, not declared
    return MeshSpec.model_validate(fields)


def _line_of(text: str, path: tuple[str | int, ...]) -> int | None:
    """Best-effort line number of a field path in the YAML source, for error messages."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in path:
        if isinstance(node, yaml.MappingNode):
            match = next((v for k, v in node.value if k.value == str(key)), None)
            if match is None:
                return line
            key_node = next(k for k, v in node.value if v is match)
            line, node = key_node.start_mark.line + 1, match
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def parse_spec(text: str, source: str = "<spec>") -> MeshSpec:
    """Parse and validate YAML text; errors name the source, the field and its line."""
    return _parse(MeshSpec, text, source)


def _parse(kind: type[Spec], text: str, source: str) -> Spec:
    try:
        data = load_yaml(text) or {}
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the spec must be a mapping, got {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = ".".join(str(p) for p in loc) or "(top level)"
            line = _line_of(text, loc)
            where = f"{source}:{line}" if line else source
            problems.append(f"{where}: {field}: {err['msg']}")
        raise SpecError("invalid mesh spec\n  " + "\n  ".join(problems)) from None


def load_spec(path: str | Path | None = None) -> MeshSpec:
    """Load a spec file; with no path, ./mesh.yaml when present, else the built-in defaults."""
    if path is None:
        default = Path("mesh.yaml")
        if not default.is_file():
            return MeshSpec()
        path = default
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_spec(text, str(path))


def parse_resolved(text: str, source: str = "<resolved spec>") -> ResolvedSpec:
    """Parse a resolved spec (every port concrete); errors as parse_spec's."""
    return _parse(ResolvedSpec, text, source)


def parse_spec_or_resolved(text: str, source: str = "<spec>") -> MeshSpec:
    """A declared spec, or a resolved one when the text names resolved ports."""
    try:
        data = load_yaml(text)
    except yaml.YAMLError:
        data = None  # parse_spec says what is wrong with it
    if isinstance(data, dict) and RESOLVED_FIELDS & set(data):
        return parse_resolved(text, source)
    return parse_spec(text, source)


def load_resolved(path: str | Path) -> ResolvedSpec:
    """Load the resolved spec a launcher wrote (what every service process reads)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror}") from None
    return _parse(ResolvedSpec, text, str(path))


def dump_spec(spec: MeshSpec) -> str:
    return dump_yaml(spec.model_dump(mode="json"))
