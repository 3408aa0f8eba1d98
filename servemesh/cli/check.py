"""`servemesh check`: validate a spec and the Envoy config it renders."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from servemesh.cli.output import console, out
from servemesh.contract.errors import UsageError
from servemesh.spec import load_spec


def cmd_check(args: argparse.Namespace) -> int:
    """Validate a spec: the typed model, then the rendered Envoy config by Envoy itself."""
    from servemesh.proxy.offline import validate_offline
    from servemesh.proxy.process import EnvoyConfigError
    from servemesh.spec import resolve

    if args.spec and args.spec_flag and args.spec != args.spec_flag:
        raise UsageError(f"two specs given: {args.spec} and --spec {args.spec_flag}")
    path = args.spec or args.spec_flag
    declared = load_spec(path)
    spec = resolve(declared)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            validate_offline(spec, Path(tmp))
        except EnvoyConfigError as exc:
            console.print(f"[red]Envoy refuses the rendered config:[/red]\n{exc}")
            return 1
    out.print(
        f"ok: {path or 'built-in defaults'} (profile {declared.profile}) is valid and "
        "renders a config Envoy accepts"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    check = sub.add_parser("check", help="validate a mesh spec and the Envoy config it renders")
    check.add_argument(
        "spec", nargs="?", help="the spec file (default: ./mesh.yaml, else built-in defaults)"
    )
    # The shared flag, for scripts that pass --spec to every command; a spec is checked
    # offline, so there is no --state-dir.
    check.add_argument("--spec", dest="spec_flag", metavar="SPEC", help="the same, as a flag")
    check.set_defaults(func=cmd_check)
