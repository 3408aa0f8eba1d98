"""`servemesh check`: validate a spec and the Envoy config it renders."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from servemesh.cli.output import console, out
from servemesh.spec import load_spec


def cmd_check(args: argparse.Namespace) -> int:
    """Validate a spec: the typed model, then the rendered Envoy config by Envoy itself."""
    from servemesh.proxy.offline import validate_offline
    from servemesh.proxy.process import EnvoyConfigError
    from servemesh.spec import resolve

    spec = resolve(load_spec(args.spec))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            validate_offline(spec, Path(tmp))
        except EnvoyConfigError as exc:
            console.print(f"[red]Envoy refuses the rendered config:[/red]\n{exc}")
            return 1
    out.print(f"ok: {args.spec or 'built-in defaults'} is valid and renders a config Envoy accepts")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    check = sub.add_parser("check", help="validate a mesh spec and the Envoy config it renders")
    check.add_argument("spec", nargs="?")
    check.set_defaults(func=cmd_check)
