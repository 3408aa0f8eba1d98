"""`servemesh envoy-config`: print the Envoy config a spec renders."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servemesh.spec import load_spec


def cmd_envoy_config(args: argparse.Namespace) -> int:
    import yaml

    from servemesh.proxy.render import render_resources, static_bootstrap
    from servemesh.spec import resolve

    spec = resolve(load_spec(args.spec))
    logs = Path(spec.state_dir) / "logs"
    config = static_bootstrap(spec, render_resources(spec, logs), logs)
    # Plain stdout: rich would wrap long lines and read [brackets] as markup.
    sys.stdout.write(yaml.safe_dump(config, sort_keys=False))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    envoy = sub.add_parser("envoy-config", help="print the Envoy config a spec renders")
    envoy.add_argument("--spec")
    envoy.set_defaults(func=cmd_envoy_config)
