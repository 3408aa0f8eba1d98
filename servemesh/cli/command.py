"""How every command ends: its return value, or one line for a `ServemeshError` and the
error's exit status, or 130 for Ctrl-C. The one place an exception becomes an exit status
(servemesh/contract/errors.py documents the statuses)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

from servemesh.cli.output import console, error
from servemesh.contract.errors import INTERRUPTED, NoMesh, ServemeshError

Command = Callable[[argparse.Namespace], int]


def command(func: Command) -> Command:
    """Wrap a command: a `ServemeshError` becomes `label: message` on stderr and its exit
    code, Ctrl-C becomes 130 (with the command's `interrupted` note, when it sets one).

    A command may name its errors (`set_defaults(error_label="models push")`); "no running
    mesh" reads the same for every command.
    """

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except NoMesh as exc:
            error("error", str(exc))
            return exc.exit_code
        except ServemeshError as exc:
            error(getattr(args, "error_label", None) or exc.label, str(exc))
            return exc.exit_code
        except KeyboardInterrupt:
            note = getattr(args, "interrupted", None)
            console.print(f"interrupted: {note}" if note else "interrupted", markup=False)
            return INTERRUPTED

    return run
