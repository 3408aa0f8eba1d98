"""The command line imports only the module of the command it runs, and parses as the
whole command line would."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from importlib import import_module

from servemesh.cli import COMMAND_MODULES, build_parser


def _registered_by(module_name: str) -> list[str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    import_module(f"servemesh.cli.{module_name}").register(sub)
    return list(sub.choices)


def test_every_command_is_named_with_the_module_that_registers_it() -> None:
    modules = dict.fromkeys(COMMAND_MODULES.values())
    registered = {name: module for module in modules for name in _registered_by(module)}
    assert registered == COMMAND_MODULES
    # And in the order the whole parser lists them.
    whole = build_parser()
    [sub] = [a for a in whole._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == list(COMMAND_MODULES)


def test_one_command_parses_as_the_whole_command_line_does() -> None:
    argv = ["routes", "set", "fraud", "v1=90", "v2=10", "--state-dir", "/tmp/x"]
    one, whole = build_parser("routes").parse_args(argv), build_parser().parse_args(argv)
    assert {k: v for k, v in vars(one).items() if k != "func"} == {
        k: v for k, v in vars(whole).items() if k != "func"
    }
    assert one.func.__qualname__ == whole.func.__qualname__


def test_a_command_imports_its_own_module_only() -> None:
    probe = (
        "import sys\n"
        "from servemesh.cli import build_parser\n"
        "build_parser('predict').parse_args(['predict', '--model', 'fraud'])\n"
        "print(sorted(m for m in sys.modules if m.startswith('servemesh.cli.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = {name.rsplit(".", 1)[1] for name in ast.literal_eval(done.stdout)}
    others = set(COMMAND_MODULES.values()) - {"predict"}
    assert "predict" in loaded
    assert not loaded & others, loaded & others
