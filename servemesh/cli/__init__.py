"""The servemesh command line: one module per command group, registered from COMMANDS.

Every command ends through `command` (servemesh/cli/command.py: a ServemeshError as one
line and its exit status, servemesh/contract/errors.py), prints through servemesh/cli/output.py,
and finds the mesh it talks to with `running_mesh` (servemesh/cli/mesh.py). docs/cli.md is
generated from `build_parser` (python -m servemesh.cli.reference).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

from servemesh.cli import (
    apply,
    auth,
    batch,
    bench,
    cache,
    capacity,
    certs,
    chaos,
    check,
    compose,
    down,
    edge,
    envoy_config,
    features,
    fleet,
    fuzz,
    load,
    log,
    models,
    predict,
    registry,
    rollout,
    routes,
    scale,
    status,
    stream,
    top,
    trace,
    up,
)
from servemesh.cli.command import command

# Each module's `register(sub)` adds its command (or commands) to the parser, in this order.
COMMANDS: list[ModuleType] = [
    up,
    status,
    down,
    predict,
    check,
    routes,
    load,
    fleet,
    rollout,
    apply,
    models,
    registry,
    edge,
    certs,
    auth,
    chaos,
    features,
    stream,
    fuzz,
    top,
    log,
    trace,
    compose,
    envoy_config,
    bench,
    batch,
    cache,
    scale,
    capacity,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servemesh",
        description="A gRPC serving mesh for PyTorch models",
        epilog="exit statuses: 0 ok, 1 refused or bad input, 2 usage, 3 rolled back, "
        "4 refused by a gate, 5 no running mesh, 130 interrupted (docs/cli.md)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = command(args.func)(args)
    if getattr(args, "exit_without_teardown", False):
        # A command whose native libraries can abort at interpreter teardown (see
        # `features load`): its output flushed, the process ends here with its code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


__all__ = ["COMMANDS", "build_parser", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
