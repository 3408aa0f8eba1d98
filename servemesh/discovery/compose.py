"""What docker-compose.yml mounts, rendered from the compose spec: `servemesh compose init`.

Inside every container the mesh's state dir is CONTAINER_STATE; the rendered folder holds
the same tree on the Docker host, and docker-compose.yml binds each container only the
parts it needs (its own certificate, the CA, the control token). Here:

    mesh.yaml                   the resolved spec every container reads
    compose.env                 the user id containers run as (the owner of the keys below)
    envoy/envoy.yaml            the edge Envoy's bootstrap (the shared layout's only one);
    envoy/envoy-<zone>.yaml     in the per-zone layout, each zone's Envoy's
    prometheus/                 prometheus.yml (compose host names) and the SLI rules
    consul/consul.json          the agent (discovery.backend consul only): one server, ACLs
                                on (default deny), mesh TLS for its health checks
    secrets/                    the Redis password and redis.conf (the same hardening as
                                the embedded Redis); Consul's management token, the
                                agent's tokens, one token per client (consul-token-*) and
                                the ACL plan the consul-acl one-shot applies
    state/control-token         the mesh's control credential
    state/tls/                  the mesh CA's certificates (keys 0600, owner only)
    state/xds/                  the edge Envoy's clusters and routes (cds/, rds/), and its
                                endpoint files (eds/), written by the control plane
    state/xds-<zone>/           the same for each zone's Envoy (per-zone layout)
    state/registry/, state/predictions/, state/traces/   the registry's store, the
                                prediction log and the trace store's spans
    state/registry-mirror-<zone>/   each zone's registry mirror's store (registry.mirrors)
    state/mesh.resolved.yaml, state/envoys-mount, state/admin/
                                what live route changes from the host need: the spec they
                                start from, where the Envoys mount the state dir, and
                                the folder of the Envoys' admin sockets (mounted into each)
    state/routes-history.jsonl  those changes, as on one machine
"""

from __future__ import annotations

import json
import os
import secrets
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from servemesh.catalog.consul_acl import AGENT, CLIENTS, CONSUL_NODE, render_plan
from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.control_credential import ensure_control_token
from servemesh.contract.errors import ServemeshError
from servemesh.contract.yaml_text import dump_yaml
from servemesh.identity import issue_mesh_certificates, mesh_identity
from servemesh.identity.enroll import edge_names
from servemesh.procs.prometheus import SERVICES_TARGETS, render_config, service_targets
from servemesh.procs.redis_server import DISABLED_COMMANDS
from servemesh.proxy.admin import admin_dir, admin_socket_path
from servemesh.proxy.process import validate_mounted
from servemesh.proxy.render import (
    dynamic_bootstrap,
    render_proxies,
    static_bootstrap,
    xds_files,
)
from servemesh.slo_rules import render_rules
from servemesh.spec import (
    TRACE_STORE_PART,
    ResolvedSpec,
    dump_spec,
    load_spec,
    proxy_part,
    registry_mirror_name,
    resolve,
)
from servemesh.state.paths import MeshPaths

# The state dir inside every container (the compose spec's `state_dir`).
CONTAINER_STATE = Path("/var/lib/servemesh")
# Where the Consul agent's own certificate (for its checks of the services) is issued.
CONSUL_IDENTITY = "consul"
CONSUL_TLS = Path("/consul/tls")
PROMETHEUS_DIR = Path("/etc/prometheus")
REDIS_PORT = 6379
# Consul's secrets (under secrets/): the management token, the agent's config holding it
# and the agent's own token, and the ACL plan; every client's token is
# `consul_token_secret(client)`, read in its container from CONTAINER_CONSUL_TOKEN (the
# compose spec's discovery.consul_token_file).
CONSUL_MANAGEMENT_TOKEN = "consul-management-token"
CONSUL_AGENT_TOKENS = "consul-agent-tokens.json"
CONSUL_ACL_PLAN = "consul-acl-plan.json"
CONTAINER_CONSUL_TOKEN = "/run/secrets/consul-token"


class ComposeError(ServemeshError, ValueError):
    """The compose spec cannot run in containers as it stands; the message says why."""


@dataclass(frozen=True)
class Rendered:
    spec: ResolvedSpec
    out: Path

    @property
    def state(self) -> Path:
        return self.out / "state"


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    atomic_write_text(path, text)
    os.chmod(path, mode)


def check_compose_spec(spec: ResolvedSpec) -> None:
    """Refuse a spec whose parts would not find each other across containers."""
    problems = []
    if Path(spec.state_dir) != CONTAINER_STATE:
        problems.append(f"state_dir: must be {CONTAINER_STATE} (the containers' state dir)")
    if spec.discovery.backend not in ("consul", "dns"):
        problems.append(
            "discovery.backend: must be consul (the control plane feeds Envoy) or dns (Envoy"
            " resolves the compose service names itself)"
        )
    if spec.discovery.listen_host != "0.0.0.0":
        problems.append("discovery.listen_host: must be 0.0.0.0 (peers are other containers)")
    parts = [i.name for i in spec.instances()] + [proxy_part(p) for p in spec.proxies()]
    parts += [registry_mirror_name(zone) for zone in spec.registry_mirror_zones()]
    if spec.embedded_trace_store_port is not None:
        parts.append(TRACE_STORE_PART)  # the mesh's own trace store: a container too
    unplaced = [part for part in parts if part not in spec.discovery.hosts]
    if unplaced:
        problems.append(
            "discovery.hosts: name every instance, Envoy, registry mirror and the trace store;"
            f" missing {unplaced}"
        )
    if spec.embedded_redis_port is not None:
        problems.append("feature_store.redis_url: name the Redis container")
    if spec.discovery.backend == "consul" and spec.discovery.consul_token_file != (
        CONTAINER_CONSUL_TOKEN
    ):
        problems.append(
            f"discovery.consul_token_file: must be {CONTAINER_CONSUL_TOKEN} (each container's"
            " own Consul token, a compose secret)"
        )
    if spec.metrics.prometheus != "off":
        problems.append("metrics.prometheus: must be off (Prometheus is a container of its own)")
    if problems:
        raise ComposeError("the compose spec cannot run in containers:\n  " + "\n  ".join(problems))


def _issue_certificates(spec: ResolvedSpec, state: Path) -> None:
    """Every identity's certificate, and the Consul agent's, in `state`/tls; Envoy's SDS
    files then name the files where containers see them."""
    local = spec.model_copy(update={"state_dir": str(state)})
    issue_mesh_certificates(local)
    identity = mesh_identity(local)
    identity.ensure([CONSUL_IDENTITY], days=spec.tls.leaf_days, extra_names=edge_names(spec))
    for sds in identity.sds_dir.glob("*.yaml"):
        text = sds.read_text().replace(str(state), str(CONTAINER_STATE))
        _write(sds, text, sds.stat().st_mode & 0o777)


def _envoy(spec: ResolvedSpec, out: Path, state: Path) -> None:
    """Each Envoy's bootstrap, clusters and routes as its container sees them (the shared
    layout's one, or the edge's and each zone's: envoy/envoy[-<zone>].yaml, with their
    files under state/xds[-<zone>]/); each validated with `envoy --mode validate` against
    the files here, every endpoint set empty (they come from the control plane)."""
    logs = CONTAINER_STATE / "logs"
    inside = MeshPaths(CONTAINER_STATE)
    (state / "logs").mkdir(parents=True, exist_ok=True)
    for proxy, resources in render_proxies(spec, logs).items():
        layout = inside.xds_of(proxy)
        for path, content in xds_files(resources, layout, "1").items():
            if path.parent.name == "eds":
                continue  # the control plane's
            _write(state / path.relative_to(CONTAINER_STATE), dump_yaml(content))
        (state / layout.root.relative_to(CONTAINER_STATE) / "eds").mkdir(
            parents=True, exist_ok=True
        )
        bootstrap = dynamic_bootstrap(spec, resources, layout, logs, proxy)
        _write(out / "envoy" / inside.envoy_config_of(proxy).name, dump_yaml(bootstrap))

        empty = {name: {"cluster_name": name, "endpoints": []} for name in resources.endpoint_sets}
        assignments = {**resources.load_assignments, **empty}
        with_empty = replace(resources, load_assignments=assignments)
        static = static_bootstrap(spec, with_empty, logs, proxy)
        validate_mounted(
            dump_yaml(static), CONTAINER_STATE, state, [admin_socket_path(CONTAINER_STATE, proxy)]
        )


def _live_changes(spec: ResolvedSpec, state: Path) -> None:
    """What `servemesh routes`, `apply` and `rollback` need to change the compose mesh's
    routing live from this host, as they change a mesh on one machine: the resolved spec
    they start from, where the Envoys mount the state dir (the files they write name the
    paths Envoy reads), and the folder the Envoys' admin sockets are mounted from (0700,
    the containers' user: the admin API is the operator's alone)."""
    here = MeshPaths(state)
    _write(here.resolved_spec, dump_spec(spec))
    _write(here.envoys_mount, f"{CONTAINER_STATE}\n")
    admin = admin_dir(state)
    admin.mkdir(mode=0o700, exist_ok=True)
    os.chmod(admin, 0o700)


def _prometheus(spec: ResolvedSpec, out: Path) -> None:
    folder = out / "prometheus"
    services = PROMETHEUS_DIR / SERVICES_TARGETS
    config = render_config(spec, PROMETHEUS_DIR / "rules.yml", services)
    _write(folder / "prometheus.yml", dump_yaml(config))
    _write(folder / SERVICES_TARGETS, json.dumps(service_targets(spec), indent=1) + "\n")
    _write(folder / "rules.yml", dump_yaml(render_rules(spec)))


def _redis(out: Path) -> None:
    """The password (kept across runs) and a redis.conf with the embedded Redis's
    hardening: a password, protected mode, no persistence, the dangerous commands gone."""
    folder = out / "secrets"
    folder.mkdir(parents=True, exist_ok=True)
    password_file = folder / "redis-password"
    if not password_file.exists():
        _write(password_file, secrets.token_urlsafe(32) + "\n", 0o600)
    password = password_file.read_text().strip()
    quoted = '"' + password.replace("\\", "\\\\").replace('"', '\\"') + '"'
    lines = [
        f"port {REDIS_PORT}",
        # Other containers call it: every interface of its own container, password required.
        "bind 0.0.0.0",
        "protected-mode yes",
        f"requirepass {quoted}",
        'save ""',
        "appendonly no",
        "dir /tmp",
        *(f'rename-command {command} ""' for command in DISABLED_COMMANDS),
    ]
    _write(folder / "redis.conf", "\n".join(lines) + "\n", 0o600)


def _kept_secret(path: Path) -> str:
    """The secret in `path`, made (a random UUID, owner-only) on the first render and kept
    across runs."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, str(uuid.uuid4()) + "\n", 0o600)
    return path.read_text().strip()


def _consul(spec: ResolvedSpec, out: Path) -> None:
    """The agent's config (ACLs on, default deny), its tokens (a secret), every client's
    token file and the plan the `consul-acl` one-shot applies (consul_acl.py)."""
    leaf = CONSUL_TLS / CONSUL_IDENTITY / "current"
    config = {
        "server": True,
        "bootstrap_expect": 1,
        "datacenter": spec.name,
        # Fixed: the agent's own token may write this node and no other.
        "node_name": CONSUL_NODE,
        "data_dir": "/consul/data",
        "client_addr": "0.0.0.0",
        "ui_config": {"enabled": True},
        # Nothing without a token: a container may only do what its own token allows
        # (register its own service name, read the catalog). The tokens themselves are in
        # the secret consul-agent-tokens.json.
        "acl": {
            "enabled": True,
            "default_policy": "deny",
            "down_policy": "extend-cache",
            "enable_token_persistence": True,
        },
        # The agent's checks present its mesh certificate: every service port requires one.
        "enable_agent_tls_for_checks": True,
        "tls": {
            "defaults": {
                "ca_file": str(CONSUL_TLS / "trust.pem"),
                "cert_file": str(leaf / "cert.pem"),
                "key_file": str(leaf / "key.pem"),
                "verify_incoming": False,
                "verify_outgoing": False,
            }
        },
    }
    _write(out / "consul" / "consul.json", json.dumps(config, indent=2) + "\n")
    secrets_dir = out / "secrets"
    management = _kept_secret(secrets_dir / CONSUL_MANAGEMENT_TOKEN)
    secret_ids = {c: _kept_secret(secrets_dir / consul_token_secret(c)) for c in CLIENTS}
    tokens = {"acl": {"tokens": {"initial_management": management, "agent": secret_ids[AGENT]}}}
    _write(secrets_dir / CONSUL_AGENT_TOKENS, json.dumps(tokens, indent=2) + "\n", 0o600)
    plan = render_plan(spec.name, secret_ids)
    _write(secrets_dir / CONSUL_ACL_PLAN, json.dumps(plan, indent=2) + "\n", 0o600)


def consul_token_secret(client: str) -> str:
    """The file (under secrets/) of `client`'s Consul token; a compose secret of that name,
    mounted in the client's container at CONTAINER_CONSUL_TOKEN."""
    return f"consul-token-{client}"


def render_compose(spec_path: Path, out: Path) -> Rendered:
    """Render every file docker-compose.yml mounts into `out` (kept across runs: the CA,
    keys, token and Redis password are created once)."""
    spec = resolve(load_spec(spec_path))
    check_compose_spec(spec)
    # Absolute: the certificates' paths in Envoy's SDS files are rewritten from it.
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = out / "state"
    state.mkdir(exist_ok=True)
    ensure_control_token(state)
    _issue_certificates(spec, state)
    mirrors = [registry_mirror_name(zone) for zone in spec.registry_mirror_zones()]
    for folder in ("registry", "predictions", "traces", *mirrors):
        (state / folder).mkdir(exist_ok=True)
    _write(out / "mesh.yaml", dump_spec(spec))
    _live_changes(spec, state)
    _envoy(spec, out, state)
    _prometheus(spec, out)
    _redis(out)
    if spec.discovery.backend == "consul":
        _consul(spec, out)
    _write(out / "compose.env", f"SERVEMESH_UID={os.getuid()}\nSERVEMESH_GID={os.getgid()}\n")
    return Rendered(spec, out)
