"""The servemesh command line: one module per command group, registered from COMMAND_MODULES.

Every command ends through `command` (servemesh/cli/command.py: a ServemeshError as one
line and its exit status, servemesh/contract/errors.py), prints through servemesh/cli/output.py,
and finds the mesh it talks to with `running_mesh` (servemesh/cli/mesh.py). docs/cli.md is
generated from `build_parser` (python -m servemesh.cli.reference).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module
from types import ModuleType

from servemesh.cli.command import command

# Each command, by name, and the module of servemesh/cli whose `register(sub)` adds it, in
# the order `servemesh --help` lists them. A named command imports its own module only:
# every module at once cost each `servemesh predict` about half a second of imports.
# tests/unit/test_cli_dispatch.py checks this against what the modules register.
COMMAND_MODULES: dict[str, str] = {
    "up": "up",
    "status": "status",
    "down": "down",
    "predict": "predict",
    "check": "check",
    "routes": "routes",
    "load": "load",
    "fleet": "fleet",
    "rollout": "rollout",
    "apply": "apply",
    "models": "models",
    "registry": "registry",
    "edge": "edge",
    "certs": "certs",
    "auth": "auth",
    "chaos": "chaos",
    "features": "features",
    "backup": "backup",
    "restore": "backup",
    "stream": "stream",
    "fuzz": "fuzz",
    "top": "top",
    "alerts": "alerts",
    "log": "log",
    "drift": "drift",
    "trace": "trace",
    "control-plane": "compose",
    "compose": "compose",
    "envoy-config": "envoy_config",
    "bench": "bench",
    "batch": "batch",
    "cache": "cache",
    "scale": "scale",
    "capacity": "capacity",
}


def command_modules(names: list[str] | None = None) -> list[ModuleType]:
    """The modules registering `names` (every command's without), each once, in order."""
    wanted = list(COMMAND_MODULES) if names is None else names
    modules = dict.fromkeys(COMMAND_MODULES[name] for name in wanted)
    return [import_module(f"servemesh.cli.{module}") for module in modules]


def build_parser(command_name: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only `command_name`'s part of it where that names one
    (what `main` runs it with: the parse and the error messages are the same)."""
    parser = argparse.ArgumentParser(
        prog="servemesh",
        description="A gRPC serving mesh for PyTorch models",
        epilog="exit statuses: 0 ok, 1 refused or bad input, 2 usage, 3 rolled back, "
        "4 refused by a gate, 5 no running mesh, 130 interrupted (docs/cli.md)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    names = [command_name] if command_name in COMMAND_MODULES else None
    for module in command_modules(names):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    args = build_parser(given[0] if given else None).parse_args(given)
    code = command(args.func)(args)
    if getattr(args, "exit_without_teardown", False):
        # A command whose native libraries can abort at interpreter teardown (see
        # `features load`): its output flushed, the process ends here with its code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


__all__ = ["COMMAND_MODULES", "build_parser", "command_modules", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
