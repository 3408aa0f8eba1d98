"""`servemesh auth`: tokens for callers of the edge (traffic.edge_auth.mode: jwt).

servemesh auth token --role caller --subject fraud-scorer --ttl 1h
servemesh auth token --role operator            # may pin a version at 0% of traffic

A token is an ES256 JWT signed with the mesh's key (`<state_dir>/auth/signing-key.pem`,
created by `servemesh up`); callers send it as `authorization: Bearer <token>`.
"""

from __future__ import annotations

import argparse
import getpass
import re

from servemesh.cli.mesh import add_mesh_flags, state_dir_of
from servemesh.cli.output import write
from servemesh.identity.tokens import TokenError, mint_token
from servemesh.spec import MeshSpec, load_spec
from servemesh.spec.durations import duration_seconds
from servemesh.state.paths import MeshPaths, NoRunningMesh

_DURATION = re.compile(r"^(\d+(ms|s|m|h|d))+$")


def spec_for(args: argparse.Namespace) -> MeshSpec:
    """The running mesh's spec under the state dir, else the spec file's (with the state
    dir given): a token needs the mesh's key, not a running mesh."""
    declared = load_spec(args.spec)
    root = state_dir_of(args)
    try:
        return MeshPaths(root).running_spec()
    except NoRunningMesh:
        return declared.model_copy(update={"state_dir": str(root)})


def ttl_seconds(text: str) -> float:
    if not _DURATION.match(text):
        raise TokenError(f"ttl: {text!r} is not a duration like 90s, 15m, 1h")
    return duration_seconds(text)


def cmd_token(args: argparse.Namespace) -> int:
    spec = spec_for(args)
    mode = spec.traffic.edge_auth.active_mode
    if mode != "jwt":
        raise TokenError(
            f"traffic.edge_auth.mode: {mode}; the edge checks tokens only with mode jwt"
        )
    token = mint_token(spec, args.role, args.subject or getpass.getuser(), ttl_seconds(args.ttl))
    write(token)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    auth = sub.add_parser("auth", help="tokens for callers of the edge (edge_auth mode jwt)")
    auth_sub = auth.add_subparsers(dest="auth_command", required=True)
    token = auth_sub.add_parser(
        "token", help="print a signed token for a role (authorization: Bearer <token>)"
    )
    token.add_argument("--role", required=True, help="one of traffic.edge_auth.roles")
    token.add_argument("--ttl", default="1h", help="how long it is good for (default 1h)")
    token.add_argument("--subject", help="who it names (default: your user name)")
    add_mesh_flags(token)
    token.set_defaults(func=cmd_token)
