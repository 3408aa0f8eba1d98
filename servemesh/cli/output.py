"""Where every command prints: one console for results (stdout), one for messages and
errors (stderr), configured once.

On a terminal rich takes the terminal's width; off one (a pipe, a file, a test) it would
wrap at 80 columns, so lines are kept whole up to PIPE_WIDTH. Markup is off by default in
what commands print from data: `plain` and `error` escape whatever they are given.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape

# Wide enough for the widest table (rollout status, log query, a trace's waterfall).
PIPE_WIDTH = 200


def _width(stream: object) -> int | None:
    isatty = getattr(stream, "isatty", None)
    return None if isatty is not None and isatty() else PIPE_WIDTH


# Results: tables, answers, reports.
out = Console(soft_wrap=True, highlight=False, width=_width(sys.stdout))
# Messages, progress and errors.
console = Console(stderr=True, soft_wrap=True, highlight=False, width=_width(sys.stderr))


def sized(width: int | None) -> Console:
    """A results console of a given width (a command's --width), else the usual one."""
    return out if width is None else Console(soft_wrap=True, highlight=False, width=width)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def write(text: str, *, err: bool = False) -> None:
    """Text as it is (JSON, a record a line): no markup, no wrapping, no highlighting;
    on stdout, or on stderr with `err`."""
    stream = (console if err else out).file
    stream.write(f"{text}\n")
    stream.flush()


def error(label: str, message: str) -> None:
    """`label: message` on stderr, as one line, the message never read as markup."""
    console.print(f"[red]{escape(label)}:[/red] {escape(one_line(message))}")


__all__ = ["PIPE_WIDTH", "console", "error", "escape", "one_line", "out", "sized", "write"]
