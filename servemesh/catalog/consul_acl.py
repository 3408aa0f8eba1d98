"""Consul's ACLs for the docker-compose topology: default deny, and one token per client
that may do only its part (docs/multihost.md).

| client | may write | may read |
| --- | --- | --- |
| a service kind (registry, model, feature, gateway) | its own service name | the catalog |
| control-plane | nothing | the catalog |
| the agent itself | its own node (`CONSUL_NODE`) | services |

`servemesh compose init` renders the plan (`render_plan`: the policies' rules and every
token's accessor and secret id, fixed there so each container's token file is written
before Consul runs); the `consul-acl` one-shot container applies it with the management
token (`apply_plan`), creating what is missing and updating what is there. Rules are
Consul's JSON form of its HCL rules.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, get_args

import consul

from servemesh.contract.errors import ServemeshError
from servemesh.spec import ServiceKind

log = logging.getLogger(__name__)

CONTROL_PLANE = "control-plane"
AGENT = "agent"
# The Consul server's node name (consul.json `node_name`): the agent's token writes it only.
CONSUL_NODE = "consul"
SERVICE_KINDS: tuple[str, ...] = get_args(ServiceKind)
# Every client with a token of its own, the agent's last (it is no container's).
CLIENTS: tuple[str, ...] = (*SERVICE_KINDS, CONTROL_PLANE, AGENT)

Rules = dict[str, dict[str, dict[str, str]]]
_READ_CATALOG: Rules = {
    "service_prefix": {"": {"policy": "read"}},
    "node_prefix": {"": {"policy": "read"}},
}


def policy_rules(client: str) -> Rules:
    """What `client`'s token may do: a service kind registers (and deregisters) its own
    service name and reads the catalog; the control plane reads it; the agent writes its
    own node."""
    if client in SERVICE_KINDS:
        return {"service": {client: {"policy": "write"}}, **_READ_CATALOG}
    if client == CONTROL_PLANE:
        return dict(_READ_CATALOG)
    if client == AGENT:
        return {
            "node": {CONSUL_NODE: {"policy": "write"}},
            "service_prefix": {"": {"policy": "read"}},
        }
    raise ValueError(f"no Consul policy for {client!r}")


def written_services(rules: Rules) -> set[str]:
    """The service names (and prefixes, marked with a trailing *) `rules` may write."""
    names = {n for n, r in rules.get("service", {}).items() if r.get("policy") != "read"}
    prefixes = {
        f"{n}*" for n, r in rules.get("service_prefix", {}).items() if r.get("policy") != "read"
    }
    return names | prefixes


def policy_name(mesh: str, client: str) -> str:
    return f"{mesh}-{client}"


def accessor_id(mesh: str, client: str) -> str:
    """A token's accessor id: not secret, the same on every render (so a re-run updates)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"servemesh:{mesh}:consul-token:{client}"))


def render_plan(mesh: str, secret_ids: dict[str, str]) -> dict[str, Any]:
    """The policies and tokens `apply_plan` makes, `secret_ids` by client (every CLIENT)."""
    return {
        "policies": {policy_name(mesh, c): policy_rules(c) for c in CLIENTS},
        "tokens": [
            {
                "client": c,
                "accessor_id": accessor_id(mesh, c),
                "secret_id": secret_ids[c],
                "policy": policy_name(mesh, c),
            }
            for c in CLIENTS
        ],
    }


class AclNotReady(ServemeshError, RuntimeError):
    """Consul did not accept the plan within the attempts given."""


def _policies_by_name(client: consul.Consul) -> dict[str, str]:
    return {p["Name"]: p["ID"] for p in client.acl.policy.list()}


def _apply_once(client: consul.Consul, plan: dict[str, Any]) -> None:
    existing = _policies_by_name(client)
    for name, rules in plan["policies"].items():
        if name in existing:
            client.acl.policy.update(existing[name], name, rules=rules)
        else:
            client.acl.policy.create(name, rules=rules)
    # Listed, not read one by one: Consul answers a missing accessor id 403 or 404 by version.
    tokens = {t["AccessorID"] for t in client.acl.token.list()}
    for token in plan["tokens"]:
        fields = {
            "accessor_id": token["accessor_id"],
            "secret_id": token["secret_id"],
            "description": f"servemesh {token['client']}",
            "policies_name": [token["policy"]],
        }
        if token["accessor_id"] in tokens:
            client.acl.token.update(**fields)
        else:
            client.acl.token.create(**fields)


def apply_plan(
    client: consul.Consul,
    plan: dict[str, Any],
    *,
    attempts: int = 30,
    every_s: float = 1.0,
    pause: Callable[[float], None] = time.sleep,
) -> None:
    """Make `plan`'s policies and tokens in Consul (`client` holds the management token).
    A leader just elected may refuse ACL writes for a moment: tried `attempts` times."""
    for attempt in range(1, attempts + 1):
        try:
            _apply_once(client, plan)
        except (consul.ConsulException, OSError) as exc:
            # The exception's text is Consul's answer; it never holds a token's secret.
            log.warning("consul ACLs not applied yet", extra={"attempt": attempt, "why": str(exc)})
            if attempt == attempts:
                raise AclNotReady(f"consul refused the ACL plan {attempts} times: {exc}") from exc
            pause(every_s)
        else:
            log.info("consul ACLs applied", extra={"policies": len(plan["policies"])})
            return
