"""docker-compose.yml and what `servemesh compose init` renders, checked statically for
what a container on the mesh network, or a machine that reaches the Docker host, could
otherwise do: only the edge is published, no password is on a command line, Consul denies
by default and each client's token may register only its own service name.

The ACL plan's application runs against a recording stand-in for py-consul's client (no
Consul agent runs here); tests/discovery/test_consul_contract.py holds the real-agent
checks, skipped where none answers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import consul
import pytest
import yaml

from servemesh.catalog.consul_acl import (
    AGENT,
    CLIENTS,
    CONSUL_NODE,
    CONTROL_PLANE,
    SERVICE_KINDS,
    AclNotReady,
    apply_plan,
    policy_rules,
    render_plan,
    written_services,
)
from servemesh.catalog.consul_catalog import TOKEN_FILE_ENV, consul_token
from servemesh.discovery.compose import (
    CONSUL_ACL_PLAN,
    CONSUL_AGENT_TOKENS,
    CONSUL_MANAGEMENT_TOKEN,
    CONTAINER_CONSUL_TOKEN,
    ComposeError,
    check_compose_spec,
    consul_token_secret,
    render_compose,
)
from servemesh.spec import SpecError, load_spec, proxy_part, resolve
from tests.discovery.test_compose_file import (
    COMPOSE,
    COMPOSE_SPEC,
    REPO,
    SecretRef,
    Service,
    _compose,
)

EDGE = "envoy"
UI_OVERRIDE = REPO / "deploy" / "compose" / "ui.yml"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compose") / "rendered"
    render_compose(COMPOSE_SPEC, out)
    return out


def _command_lines(service: Service) -> list[str]:
    """Every string a container runs: command, entrypoint, health check."""
    extra = service.model_extra or {}
    found: list[str] = []
    for key in ("command", "entrypoint"):
        value = extra.get(key)
        found += [value] if isinstance(value, str) else list(value or [])
    if service.healthcheck is not None:
        found += service.healthcheck.test or []
    return [str(part) for part in found]


def _mounted_as(service: Service, target: str) -> list[str]:
    """The secrets mounted at /run/secrets/<target> in `service`."""
    return [
        s.source if isinstance(s, SecretRef) else s
        for s in service.secrets
        if (s.target if isinstance(s, SecretRef) else s) == target
    ]


def _instance_kind(service: Service) -> str | None:
    """The service kind a container runs (its command's `servemesh.services.<kind>` or
    `servemesh.<kind>` module with an --instance), None for any other container."""
    command = _command_lines(service)
    if "--instance" not in command or "-m" not in command:
        return None
    module = command[command.index("-m") + 1]
    return module.rsplit(".", 1)[-1]


# --- only the edge is published ------------------------------------------------------


def test_only_the_edge_listener_is_published() -> None:
    compose = _compose()
    published = {name: s.ports for name, s in compose.services.items() if s.ports}
    spec = resolve(load_spec(COMPOSE_SPEC))
    # Each zone's edge listener, and nothing else.
    edges = {proxy_part(p): spec.edge_port_of(p) for p in spec.edge_proxies()}
    assert len(edges) == len(spec.zones)
    assert published == {name: [f"{port}:{port}"] for name, port in edges.items()}
    assert "expose" not in (compose.services[EDGE].model_extra or {})
    for name, service in compose.services.items():
        extra = service.model_extra or {}
        assert extra.get("network_mode") != "host", name


def test_the_ui_override_binds_the_host_s_loopback_only() -> None:
    override = yaml.safe_load(UI_OVERRIDE.read_text())
    assert set(override["services"]) == {"prometheus", "jaeger"}
    for name, service in override["services"].items():
        for port in service["ports"]:
            assert port.startswith("127.0.0.1:"), f"{name}: {port}"


# --- no password on a command line ---------------------------------------------------

# redis-cli's -a/--pass, Redis's requirepass, and --password=/--token= flags.
PASSWORD_FLAG = re.compile(r"(?i)(requirepass|(^|\s)-a(\s|$)|--pass\b|--password|--token\b)")


def test_no_password_or_token_is_on_any_command_line(rendered: Path) -> None:
    compose = _compose()
    secrets = [
        path.read_text().strip()
        for path in (rendered / "secrets").iterdir()
        if path.name == "redis-password" or path.name.startswith("consul-token")
    ]
    secrets.append((rendered / "secrets" / CONSUL_MANAGEMENT_TOKEN).read_text().strip())
    text = COMPOSE.read_text()
    for secret in secrets:
        assert secret not in text
    for name, service in compose.services.items():
        for part in _command_lines(service):
            assert not PASSWORD_FLAG.search(part), f"{name}: {part}"
        for key, value in service.environment.items():
            # Environment names files (…_FILE), never holds a secret itself.
            if re.search(r"(?i)password|token|auth", key):
                assert value.startswith("/run/secrets/"), f"{name}: {key}"


def test_redis_s_health_check_reads_the_password_into_redis_cli_s_environment() -> None:
    redis = _compose().services["redis"]
    (check,) = [part for part in _command_lines(redis) if "redis-cli" in part]
    assert 'REDISCLI_AUTH="$$(cat /run/secrets/redis-password)" redis-cli ping' in check
    assert "redis-password" in redis.secrets


# --- Consul: default deny, a token per client ----------------------------------------


def test_consul_enables_acls_denying_by_default(rendered: Path) -> None:
    config = json.loads((rendered / "consul" / "consul.json").read_text())
    acl = config["acl"]
    assert acl["enabled"] is True and acl["default_policy"] == "deny"
    assert acl["enable_token_persistence"] is True
    assert "tokens" not in acl  # the tokens are a secret's, not this mounted config's
    assert config["node_name"] == CONSUL_NODE

    tokens = json.loads((rendered / "secrets" / CONSUL_AGENT_TOKENS).read_text())["acl"]["tokens"]
    management = (rendered / "secrets" / CONSUL_MANAGEMENT_TOKEN).read_text().strip()
    assert tokens["initial_management"] == management
    assert (
        tokens["agent"] == (rendered / "secrets" / consul_token_secret(AGENT)).read_text().strip()
    )
    for secret in (rendered / "secrets").iterdir():
        assert secret.stat().st_mode & 0o077 == 0, secret.name

    consul_service = _compose().services["consul"]
    command = _command_lines(consul_service)
    assert "-config-file=/consul/config/consul.json" in command
    assert f"-config-file=/run/secrets/{CONSUL_AGENT_TOKENS}" in command
    assert _mounted_as(consul_service, CONSUL_AGENT_TOKENS) == ["consul-agent-tokens"]
    assert consul_service.environment == {TOKEN_FILE_ENV: CONTAINER_CONSUL_TOKEN}


def test_a_render_keeps_the_tokens_it_made(tmp_path: Path) -> None:
    out = tmp_path / "rendered"
    render_compose(COMPOSE_SPEC, out)
    first = {p.name: p.read_text() for p in (out / "secrets").iterdir()}
    render_compose(COMPOSE_SPEC, out)
    assert {p.name: p.read_text() for p in (out / "secrets").iterdir()} == first
    assert len({first[consul_token_secret(c)] for c in CLIENTS}) == len(CLIENTS)


def test_each_service_s_token_policy_names_only_its_own_service(rendered: Path) -> None:
    plan = json.loads((rendered / "secrets" / CONSUL_ACL_PLAN).read_text())
    by_secret = {t["secret_id"]: plan["policies"][t["policy"]] for t in plan["tokens"]}
    compose = _compose()
    kinds_seen = set()
    for name, service in compose.services.items():
        kind = _instance_kind(service)
        if kind == "mirror":
            # A registry mirror registers nothing (it is dialled by address): no token.
            assert _mounted_as(service, "consul-token") == [], name
            continue
        if kind is None:
            continue
        kinds_seen.add(kind)
        # The container's one token is its own kind's, and its policy writes that name only.
        assert _mounted_as(service, "consul-token") == [consul_token_secret(kind)], name
        secret = (rendered / "secrets" / consul_token_secret(kind)).read_text().strip()
        assert written_services(by_secret[secret]) == {kind}, name
    assert kinds_seen == set(SERVICE_KINDS)
    # The control plane only reads; the agent writes its own node and no service.
    assert _mounted_as(compose.services["control-plane"], "consul-token") == [
        consul_token_secret(CONTROL_PLANE)
    ]
    assert written_services(policy_rules(CONTROL_PLANE)) == set()
    assert written_services(policy_rules(AGENT)) == set()
    assert policy_rules(AGENT)["node"] == {CONSUL_NODE: {"policy": "write"}}
    for rules in plan["policies"].values():
        assert "acl" not in rules and "key_prefix" not in rules and "operator" not in rules
        assert "node_prefix" not in rules or rules["node_prefix"] == {"": {"policy": "read"}}


def test_the_management_token_is_mounted_in_consul_and_its_one_shot_only() -> None:
    compose = _compose()
    holders = {
        name
        for name, service in compose.services.items()
        for s in service.secrets
        if (s.source if isinstance(s, SecretRef) else s) == "consul-management-token"
    }
    assert holders == {"consul", "consul-acl"}
    one_shot = compose.services["consul-acl"]
    assert one_shot.restart == "no"
    assert "--plan" in _command_lines(one_shot)
    # Everything that talks to Consul waits for the tokens to exist.
    for name, service in compose.services.items():
        if _mounted_as(service, "consul-token") and name not in holders:
            assert "consul-acl" in service.depends_on, name


def test_a_compose_spec_without_the_container_token_file_is_refused() -> None:
    spec = resolve(load_spec(COMPOSE_SPEC))
    check_compose_spec(spec)
    unset = spec.model_copy(
        update={"discovery": spec.discovery.model_copy(update={"consul_token_file": None})}
    )
    with pytest.raises(ComposeError, match="discovery.consul_token_file"):
        check_compose_spec(unset)


# --- the ACL plan applied, and the token read -----------------------------------------


class RecordingConsul:
    """py-consul's acl.policy and acl.token, as calls recorded and a state kept; refuses
    the first `refusals` calls as a leader just elected may."""

    def __init__(self, refusals: int = 0) -> None:
        self.refusals = refusals
        self.policies: dict[str, dict[str, Any]] = {}
        self.tokens: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.acl = self
        self.policy = _Policies(self)
        self.token = _Tokens(self)

    def called(self, what: str) -> None:
        self.calls.append(what)
        if self.refusals:
            self.refusals -= 1
            raise consul.ConsulException("500 No cluster leader")


class _Policies:
    def __init__(self, consul_: RecordingConsul) -> None:
        self.c = consul_

    def list(self) -> list[dict[str, str]]:
        self.c.called("policy.list")
        return [{"Name": name, "ID": p["id"]} for name, p in self.c.policies.items()]

    def create(self, name: str, rules: Any = None) -> None:
        self.c.called("policy.create")
        self.c.policies[name] = {"id": f"id-{name}", "rules": rules}

    def update(self, uuid: str, name: str, rules: Any = None) -> None:
        self.c.called("policy.update")
        assert self.c.policies[name]["id"] == uuid
        self.c.policies[name]["rules"] = rules


class _Tokens:
    def __init__(self, consul_: RecordingConsul) -> None:
        self.c = consul_

    def list(self) -> list[dict[str, str]]:
        self.c.called("token.list")
        return [{"AccessorID": a} for a in self.c.tokens]

    def create(self, **fields: Any) -> None:
        self.c.called("token.create")
        self.c.tokens[fields["accessor_id"]] = fields

    def update(self, **fields: Any) -> None:
        self.c.called("token.update")
        self.c.tokens[fields["accessor_id"]] = fields


def _plan() -> dict[str, Any]:
    return render_plan("compose", {c: f"secret-{c}" for c in CLIENTS})


def test_the_plan_is_applied_once_and_then_updated_in_place() -> None:
    fake = RecordingConsul()
    plan = _plan()
    apply_plan(fake, plan, pause=lambda s: None)
    assert set(fake.policies) == {f"compose-{c}" for c in CLIENTS}
    assert {t["secret_id"] for t in fake.tokens.values()} == {f"secret-{c}" for c in CLIENTS}
    gateway = next(t for t in fake.tokens.values() if t["secret_id"] == "secret-gateway")
    assert gateway["policies_name"] == ["compose-gateway"]
    assert fake.policies["compose-gateway"]["rules"]["service"] == {"gateway": {"policy": "write"}}

    fake.calls.clear()
    apply_plan(fake, plan, pause=lambda s: None)
    assert "policy.create" not in fake.calls and "token.create" not in fake.calls
    assert fake.calls.count("token.update") == len(CLIENTS)
    assert len(fake.tokens) == len(CLIENTS)


def test_a_refusing_leader_is_retried_then_given_up_on() -> None:
    pauses: list[float] = []
    fake = RecordingConsul(refusals=2)
    apply_plan(fake, _plan(), attempts=3, every_s=0.5, pause=pauses.append)
    assert pauses == [0.5, 0.5] and len(fake.tokens) == len(CLIENTS)
    with pytest.raises(AclNotReady, match="3 times"):
        apply_plan(RecordingConsul(refusals=99), _plan(), attempts=3, pause=pauses.append)


def test_the_token_comes_from_the_spec_s_file_else_the_environment_s(tmp_path: Path) -> None:
    spec = resolve(load_spec(COMPOSE_SPEC))
    mine = tmp_path / "token"
    mine.write_text("s3cr3t-token-value\n")
    named = spec.model_copy(
        update={"discovery": spec.discovery.model_copy(update={"consul_token_file": str(mine)})}
    )
    assert consul_token(named, environ={}) == "s3cr3t-token-value"
    unnamed = spec.model_copy(
        update={"discovery": spec.discovery.model_copy(update={"consul_token_file": None})}
    )
    assert consul_token(unnamed, environ={}) is None
    assert consul_token(unnamed, environ={TOKEN_FILE_ENV: str(mine)}) == "s3cr3t-token-value"
    with pytest.raises(SpecError, match=TOKEN_FILE_ENV) as missing:
        consul_token(unnamed, environ={TOKEN_FILE_ENV: str(tmp_path / "absent")})
    assert "s3cr3t" not in str(missing.value)
