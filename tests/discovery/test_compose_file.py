"""docker-compose.yml checked for what the topology relies on, without a Docker engine.

No engine and no `docker compose` plugin run here, so `docker compose config` cannot; this
checks the file's structure with pydantic: what each service must have, that every
dependency waits on a health check (or a finished one-shot), that every file it mounts is
one `servemesh compose init` renders, that it mirrors the compose spec's instances, and
that no secret is written inline.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from servemesh.cli.compose import instance_of_pid1
from servemesh.discovery.compose import ComposeError, check_compose_spec, render_compose
from servemesh.spec import (
    EDGE_PROXY,
    ENVOY_PART,
    load_spec,
    proxy_part,
    registry_mirror_name,
    resolve,
)

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_SPEC = REPO / "deploy" / "compose" / "mesh.yaml"
RENDERED = "./deploy/compose/rendered/"


class Healthcheck(BaseModel):
    model_config = ConfigDict(extra="forbid")
    test: list[str] | None = None
    disable: bool = False
    interval: str | None = None
    timeout: str | None = None
    retries: int | None = None
    start_period: str | None = None

    @model_validator(mode="after")
    def _a_command_or_disabled(self) -> Healthcheck:
        if not self.disable and not (self.test and self.test[0] in {"CMD", "CMD-SHELL"}):
            raise ValueError("healthcheck.test: CMD or CMD-SHELL, or disable: true")
        return self


class Dependency(BaseModel):
    model_config = ConfigDict(extra="forbid")
    condition: Literal["service_healthy", "service_completed_successfully"]


class SecretRef(BaseModel):
    """A secret mounted under a name of its own: /run/secrets/<target>."""

    model_config = ConfigDict(extra="forbid")
    source: str
    target: str


class Service(BaseModel):
    model_config = ConfigDict(extra="allow")
    image: str | None = None
    build: str | None = None
    healthcheck: Healthcheck | None = None
    depends_on: dict[str, Dependency] = Field(default_factory=dict)
    volumes: list[str] = Field(default_factory=list)
    networks: list[str] | dict[str, object] = Field(default_factory=list)
    secrets: list[str | SecretRef] = Field(default_factory=list)
    environment: dict[str, str] = Field(default_factory=dict)
    restart: str | None = None
    ports: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _runnable(self) -> Service:
        if self.image is None and self.build is None:
            raise ValueError("image or build: one is needed")
        return self


class ComposeFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    services: dict[str, Service]
    networks: dict[str, object]
    volumes: dict[str, object] = Field(default_factory=dict)
    secrets: dict[str, dict[str, str]] = Field(default_factory=dict)


def _compose() -> ComposeFile:
    return ComposeFile.model_validate(yaml.safe_load(COMPOSE.read_text()))


def _secret_sources(service: Service) -> list[str]:
    return [s if isinstance(s, str) else s.source for s in service.secrets]


def _one_shots(compose: ComposeFile) -> set[str]:
    return {name for name, s in compose.services.items() if s.restart == "no"}


def test_every_service_has_an_image_and_a_health_check_unless_it_runs_once() -> None:
    compose = _compose()
    for name, service in compose.services.items():
        if name in _one_shots(compose):
            continue
        assert service.healthcheck is not None and not service.healthcheck.disable, name


def test_every_dependency_waits_for_a_health_check_or_a_finished_one_shot() -> None:
    compose = _compose()
    one_shots = _one_shots(compose)
    for name, service in compose.services.items():
        for dependency, wait in service.depends_on.items():
            assert dependency in compose.services, f"{name} depends on unknown {dependency}"
            if wait.condition == "service_completed_successfully":
                assert dependency in one_shots, f"{name}: {dependency} never completes"
            else:
                target = compose.services[dependency]
                assert target.healthcheck is not None and not target.healthcheck.disable, (
                    f"{name} waits for {dependency}, which has no health check"
                )


def test_the_dependencies_have_no_cycle() -> None:
    compose = _compose()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for dependency in compose.services[name].depends_on:
            visit(dependency, (*path, name))
        done.add(name)

    for name in compose.services:
        visit(name, ())


def test_networks_volumes_and_secrets_used_are_declared() -> None:
    compose = _compose()
    for name, service in compose.services.items():
        networks = (
            service.networks if isinstance(service.networks, list) else list(service.networks)
        )
        assert set(networks) <= set(compose.networks), name
        for secret in _secret_sources(service):
            assert secret in compose.secrets, f"{name}: undeclared secret {secret}"
        for volume in service.volumes:
            source = volume.split(":")[0]
            if not source.startswith("."):
                assert source in compose.volumes, f"{name}: undeclared volume {source}"


def test_it_mirrors_the_compose_spec_every_instance_a_service_of_its_name() -> None:
    spec = resolve(load_spec(COMPOSE_SPEC))
    check_compose_spec(spec)
    compose = _compose()
    for inst in spec.instances():
        assert spec.host_of(inst.name) == inst.name
        command = compose.services[inst.name].model_extra["command"]  # type: ignore[index]
        assert command[-2:] == ["--instance", inst.name]
    # An Envoy container per Envoy of the spec: the edge's, and each zone's.
    assert spec.proxy.layout == "per_zone"
    for proxy in spec.proxies():
        assert spec.host_of(proxy_part(proxy)) == proxy_part(proxy)
        assert proxy_part(proxy) in compose.services, proxy
    assert spec.host_of(ENVOY_PART) in compose.services
    assert spec.tracing.otlp_endpoint is not None
    jaeger = compose.services["jaeger"].networks
    assert isinstance(jaeger, dict)
    assert spec.tracing.otlp_endpoint.split(":")[0] == jaeger["mesh"]["ipv4_address"]  # type: ignore[index]
    assert compose.services["envoy"].image == "envoyproxy/envoy:v1.40.0"


def test_no_secret_is_written_inline() -> None:
    text = COMPOSE.read_text()
    assert not re.search(r"(?i)(password|token|secret)\s*[:=]\s*['\"]?\w{8,}", text)
    for secret in _compose().secrets.values():
        assert set(secret) == {"file"} and secret["file"].startswith(RENDERED)


def test_every_mounted_file_is_one_compose_init_renders(tmp_path: Path) -> None:
    out = tmp_path / "rendered"
    render_compose(COMPOSE_SPEC, out)
    compose = _compose()
    sources = [v.split(":")[0] for s in compose.services.values() for v in s.volumes]
    sources += [s["file"] for s in compose.secrets.values()]
    for source in sources:
        if source.startswith(RENDERED):
            assert (out / source.removeprefix(RENDERED)).exists(), source
    # Private keys stay owner-only; Envoy's SDS files name where the containers see them.
    key = out / "state" / "tls" / "gateway-zone-a-0" / "current" / "key.pem"
    assert key.stat().st_mode & 0o077 == 0
    assert str(out) not in (out / "state" / "tls" / "sds" / "envoy.yaml").read_text()
    # The hardening of the embedded Redis, and no persistence.
    conf = (out / "secrets" / "redis.conf").read_text()
    assert "protected-mode yes" in conf and 'rename-command FLUSHALL ""' in conf
    assert (out / "secrets" / "redis.conf").stat().st_mode & 0o077 == 0


def test_the_render_lets_host_commands_change_routes_where_the_envoys_mount_it(
    tmp_path: Path,
) -> None:
    """What `routes set` on the host needs: the running spec read here names this state dir
    (its certificates, history, sockets), while the files it writes name the containers'
    paths, and every Envoy mounts the admin sockets' folder (owner only)."""
    from servemesh.proxy.admin import admin_dir
    from servemesh.state.paths import MeshPaths

    out = tmp_path / "rendered"
    render_compose(COMPOSE_SPEC, out)
    here = MeshPaths(out.resolve() / "state")
    assert here.running_spec().state_dir == str(here.state_dir)
    seen = here.as_envoys_see_it()
    assert seen.state_dir == Path("/var/lib/servemesh")
    rds = seen.xds_of(EDGE_PROXY).rds("edge")
    assert here.here(rds) == here.state_dir / "xds" / "rds" / "edge.yaml"
    assert admin_dir(here.state_dir).stat().st_mode & 0o777 == 0o700
    for name, service in _compose().services.items():
        if name.startswith(ENVOY_PART):
            mounts = [v.split(":")[:2] for v in service.volumes]
            assert [f"{RENDERED}state/admin", "/var/lib/servemesh/admin"] in mounts, name
    # On one machine nothing moves.
    local = MeshPaths(tmp_path / "local")
    assert local.as_envoys_see_it() == local


def test_a_spec_that_cannot_run_in_containers_is_refused_naming_the_fields() -> None:
    with pytest.raises(ComposeError, match=r"discovery\.backend.*\n.*listen_host"):
        check_compose_spec(resolve(load_spec(REPO / "mesh.yaml")))


def test_the_image_installs_every_package_of_the_tree() -> None:
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    for init in (REPO / "servemesh").rglob("__init__.py"):
        package = ".".join(init.parent.relative_to(REPO).parts)
        assert package in listed, f"pyproject.toml packages lacks {package}"
    # A folder of modules without an __init__.py imports from a checkout (a namespace
    # package) and is left out of an installed one: every such folder is a package.
    for module in (REPO / "servemesh").rglob("*.py"):
        if "__pycache__" not in module.parts:
            assert (module.parent / "__init__.py").is_file(), f"{module.parent} has no __init__.py"


def test_the_probe_finds_the_instance_in_the_container_s_command(tmp_path: Path) -> None:
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"python\0-m\0servemesh.services.model\0--instance\0model-fraud-zone-a-0\0")
    assert instance_of_pid1(cmdline) == "model-fraud-zone-a-0"
    cmdline.write_bytes(b"servemesh\0compose\0seed\0")
    assert instance_of_pid1(cmdline) is None


def test_each_zone_has_an_envoy_container_of_its_own_that_its_gateways_wait_for() -> None:
    """One Envoy per zone and one for the edge: a zone's gateways dial their zone's Envoy
    (the spec's mesh address names its container) and start after it; a zone's Envoy
    mounts its own bootstrap and watched files, and not the edge's key; the edge's alone
    publishes a port; the control plane writes every Envoy's endpoint files."""
    spec = resolve(load_spec(COMPOSE_SPEC))
    compose = _compose()
    for zone in spec.zones:
        envoy = proxy_part(zone)
        assert spec.mesh_address_for(zone).split(":")[0] == envoy
        for inst in spec.instances():
            if inst.service == "gateway" and inst.zone == zone:
                assert envoy in compose.services[inst.name].depends_on, inst.name
        mounts = [v.split(":")[1] for v in compose.services[envoy].volumes]
        assert f"/var/lib/servemesh/xds-{zone}/cds" in mounts
        assert not [m for m in mounts if m.endswith("/tls/edge")], mounts
        assert not compose.services[envoy].ports
        bootstrap = compose.services[envoy].volumes[0].split(":")[0]
        assert bootstrap == f"{RENDERED}envoy/envoy-{zone}.yaml"
    assert compose.services[proxy_part(EDGE_PROXY)].ports == ["8080:8080"]
    plane = [v.split(":")[1] for v in compose.services["control-plane"].volumes]
    for folder in ["xds", *(f"xds-{zone}" for zone in spec.zones)]:
        assert f"/var/lib/servemesh/{folder}/eds" in plane, folder


@pytest.mark.parametrize(
    ("spec", "compose_file"),
    [("mesh.yaml", "docker-compose.yml"), ("mesh-dns.yaml", "deploy/compose/dns.yml")],
)
def test_init_names_the_compose_file_that_runs_what_it_rendered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, compose_file: str
) -> None:
    from servemesh.cli import main

    out = tmp_path / "rendered"
    code = main(["compose", "init", "--spec", str(COMPOSE_SPEC.parent / spec), "--out", str(out)])
    assert code == 0
    [hint] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("next:")]
    assert f"--env-file {out}/compose.env" in hint
    # The Consul file is compose's default one; the DNS file must be named.
    assert ("dns.yml" in hint) == (compose_file != "docker-compose.yml"), hint
    assert (REPO / compose_file).exists()


DNS_COMPOSE = REPO / "deploy" / "compose" / "dns.yml"
DNS_SPEC = REPO / "deploy" / "compose" / "mesh-dns.yaml"


def test_in_the_dns_compose_file_each_zone_is_a_network_and_only_envoys_cross_zones() -> None:
    """A zone's gateway, feature and model containers are on their zone's network alone;
    the registry, Redis (shared by the zones) on every zone's network; the seed on one;
    a zone's registry mirror on its zone's; each zone's edge on `front` and every zone's
    network (it reaches each gateway), the edges the only containers publishing a port;
    each zone's Envoy on every zone's network (its own, and its failover path, which a
    partition cuts). So once each zone's Envoy leaves the other
    zones' networks, no container of one zone shares a network with another zone's
    replicas."""
    spec = resolve(load_spec(DNS_SPEC))
    compose = ComposeFile.model_validate(yaml.safe_load(DNS_COMPOSE.read_text()))

    def networks(name: str) -> set[str]:
        found = compose.services[name].networks
        return set(found if isinstance(found, list) else found)

    zones = set(spec.zones)
    assert set(compose.networks) == {"front", *zones}
    for inst in spec.instances():
        if inst.service == "registry":
            assert networks(inst.name) == zones
        else:
            assert networks(inst.name) == {inst.zone}, inst.name
    assert networks("redis") == zones and len(networks("seed") & zones) == 1
    for zone in zones:
        assert networks(proxy_part(zone)) == zones, zone
    edges = [proxy_part(proxy) for proxy in spec.edge_proxies()]
    assert len(edges) == len(zones)  # an edge per zone
    for edge in edges:
        assert networks(edge) == {"front", *zones}, edge
    # A zone's registry mirror is its zone's (the registry is on every zone's network).
    for zone in spec.registry_mirror_zones():
        assert networks(registry_mirror_name(zone)) == {zone}
    published = [name for name, service in compose.services.items() if service.ports]
    assert sorted(published) == sorted(edges)


def test_the_compose_mesh_traces_into_a_trace_store_container_envoy_resolves(
    tmp_path: Path,
) -> None:
    """Tracing on in the DNS compose spec: the trace store is a container (tracestore-0)
    on every zone's network, checked at the port the render gives it; the Envoys' trace
    collector is a DNS cluster of its name over mutual TLS, and the services export to
    the same name."""
    from servemesh.discovery.compose import render_compose
    from servemesh.spec import TRACE_STORE_PART

    rendered = render_compose(DNS_SPEC, tmp_path / "out")
    spec = rendered.spec
    port = spec.embedded_trace_store_port
    assert spec.tracing.enabled and port is not None
    assert spec.tracing.otlp_endpoint == f"{TRACE_STORE_PART}:{port}"
    assert (tmp_path / "out" / "state" / "tls" / TRACE_STORE_PART).is_dir()
    for file in (DNS_COMPOSE, REPO / "deploy" / "compose" / "stack.yml"):
        raw = yaml.safe_load(file.read_text())["services"][TRACE_STORE_PART]
        assert set(raw["networks"]) == set(spec.zones), file
        assert f"127.0.0.1:{port}" in " ".join(raw["healthcheck"]["test"]), file
    clusters = yaml.safe_load(
        (tmp_path / "out" / "state" / "xds" / "cds" / "clusters.yaml").read_text()
    )
    [collector] = [c for c in clusters["resources"] if c["name"] == "trace_collector"]
    assert collector["cluster_type"]["name"] == "envoy.cluster.dns"
    assert "transport_socket" in collector
    address = collector["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert address["address"]["socket_address"] == {"address": TRACE_STORE_PART, "port_value": port}


def test_a_collector_named_by_host_name_needs_dns_discovery() -> None:
    from servemesh.spec import MeshSpec

    with pytest.raises(ValueError, match="only discovery.backend dns"):
        MeshSpec.model_validate({"tracing": {"otlp_endpoint": "jaeger:4317"}})
    named = {"otlp_endpoint": "jaeger:4317"}
    dns = MeshSpec.model_validate({"tracing": named, "discovery": {"backend": "dns"}})
    assert dns.tracing.otlp_endpoint == "jaeger:4317"
