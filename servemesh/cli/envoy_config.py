"""`servemesh envoy-config`: print the Envoy config a spec renders."""

from __future__ import annotations

import argparse
from pathlib import Path

from servemesh.cli.output import write
from servemesh.spec import EDGE_PROXY, SpecError, load_spec


def cmd_envoy_config(args: argparse.Namespace) -> int:
    import yaml

    from servemesh.proxy.render import render_resources, static_bootstrap
    from servemesh.spec import resolve

    spec = resolve(load_spec(args.spec))
    if args.proxy not in spec.proxies():
        raise SpecError(
            f"--proxy: no Envoy named {args.proxy!r} in this spec; Envoys: {spec.proxies()}"
        )
    logs = Path(spec.state_dir) / "logs"
    resources = render_resources(spec, logs, args.proxy)
    config = static_bootstrap(spec, resources, logs, args.proxy)
    # Plain stdout: rich would wrap long lines and read [brackets] as markup.
    write(yaml.safe_dump(config, sort_keys=False).rstrip("\n"))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    envoy = sub.add_parser("envoy-config", help="print the Envoy config a spec renders")
    envoy.add_argument("--spec")
    envoy.add_argument(
        "--proxy",
        default=EDGE_PROXY,
        help="which Envoy (proxy.layout per_zone: a zone's name; default: the edge's, the "
        "shared layout's only one)",
    )
    envoy.set_defaults(func=cmd_envoy_config)
