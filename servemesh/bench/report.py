"""What a benchmark hands back, and the one place that shows it.

Every benchmark's `main` returns a BenchReport: its JSON payload, and what people read of it
(a heading, then tables, same-run ratios and notes, in order). `emit` is the tail every
`servemesh bench` command shares: it writes the payload where `--json-out` says, then
prints either the payload as JSON (`--json`) or the report for people.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    # rich is loaded when a report is shown, not by every process that imports a bench.
    from rich.console import Console, JustifyMethod
    from rich.table import Table as RichTable

T = TypeVar("T")


@dataclass(frozen=True)
class Table:
    """A table for people, its cells formatted already (rich markup is read in them)."""

    title: str
    columns: Sequence[str]
    # Columns justified left; the others right.
    left: Collection[str] = ()
    title_justify: JustifyMethod = "center"
    rows: list[tuple[str, ...]] = field(default_factory=list)

    def add_row(self, *cells: str) -> None:
        self.rows.append(cells)

    def rich(self) -> RichTable:
        from rich.table import Table as RichTable

        table = RichTable(title=self.title, title_justify=self.title_justify)
        for column in self.columns:
            table.add_column(column, justify="left" if column in self.left else "right")
        for row in self.rows:
            table.add_row(*row)
        return table


@dataclass(frozen=True)
class Ratio:
    """A ratio measured within one run: its median over the repeats and each repeat's value.

    Printed as `name: 1.23x (per repeat 1.20, 1.23, 1.31)` with `digits` decimals; with
    digits None, as the payload holds them (`name: 1.234x (per repeat [1.2, 1.234])`)."""

    name: str
    median: float
    per_repeat: Sequence[float]
    digits: int | None = 2

    @property
    def spread(self) -> float | None:
        """(max - min) / median over the repeats; None with no repeat or a zero median."""
        if not self.per_repeat or not self.median:
            return None
        return (max(self.per_repeat) - min(self.per_repeat)) / self.median

    def line(self) -> str:
        if self.digits is None:
            return f"{self.name}: {self.median}x (per repeat {list(self.per_repeat)})"
        d = self.digits
        listed = ", ".join(f"{v:.{d}f}" for v in self.per_repeat)
        return f"{self.name}: {self.median:.{d}f}x (per repeat {listed})"


@dataclass(frozen=True)
class Note:
    """A line (or lines) of text, printed as it is; rich markup only where `markup` says."""

    text: str
    markup: bool = False


Block = Table | Ratio | Note


@dataclass
class BenchReport:
    """One benchmark run: what `--json` prints and `--json-out` writes (payload), and what
    people read: the heading (title), then the body's tables, ratios and notes in order."""

    # The command that produced it, e.g. "servemesh bench predict".
    command: str
    # JSON-able: printed by --json, written by --json-out, as it is.
    payload: Any
    title: str | None = None
    body: list[Block] = field(default_factory=list)
    # The least width its tables are laid out in (wider on a wider terminal); None: the
    # terminal's, or 80 off one.
    width: int | None = None
    # The command's exit status (a run with failed calls may ask for 1).
    status: int = 0

    def table(
        self,
        title: str,
        columns: Sequence[str],
        *,
        left: Collection[str] = (),
        title_justify: JustifyMethod = "center",
    ) -> Table:
        """A new table at the end of the body; its rows are added to what this returns."""
        table = Table(title, tuple(columns), left=left, title_justify=title_justify)
        self.body.append(table)
        return table

    def ratio(
        self, name: str, median: float, per_repeat: Sequence[float], *, digits: int | None = 2
    ) -> None:
        self.body.append(Ratio(name, median, per_repeat, digits))

    def note(self, text: str, *, markup: bool = False) -> None:
        self.body.append(Note(text, markup))

    @property
    def tables(self) -> list[Table]:
        return [b for b in self.body if isinstance(b, Table)]

    @property
    def ratios(self) -> list[Ratio]:
        return [b for b in self.body if isinstance(b, Ratio)]

    @property
    def notes(self) -> list[Note]:
        return [b for b in self.body if isinstance(b, Note)]


def emit(
    report: BenchReport,
    *,
    json_stdout: bool,
    json_out: str | Path | None,
    console: Console | None = None,
) -> None:
    """Write the payload to `json_out` (when given), then print the payload as JSON
    (`json_stdout`) or the report for people, on `console` (default: stdout, at least
    the report's width)."""
    from rich.console import Console

    text = json.dumps(report.payload, indent=2)
    if json_out:
        Path(json_out).write_text(text + "\n")
    if console is None:
        console = Console(width=max(Console().width, report.width)) if report.width else Console()
    if json_stdout:
        console.file.write(text + "\n")
        console.file.flush()
        return
    if report.title:
        _line(console, Note(report.title))
    for block in report.body:
        if isinstance(block, Table):
            console.print(block.rich())
        elif isinstance(block, Ratio):
            _line(console, Note(block.line()))
        else:
            _line(console, block)


def _line(console: Console, note: Note) -> None:
    # Whole lines: a figure is never wrapped onto the next line, nor read as markup.
    console.print(note.text, markup=note.markup, highlight=False, emoji=False, soft_wrap=True)


def progress(quiet: bool, line: Callable[[T], str]) -> Callable[[T], None]:
    """How a benchmark tells each round as it ends: `line(round)` on stdout at once, unless
    the report goes out as JSON (`quiet`)."""

    def say(found: T) -> None:
        if not quiet:
            print(line(found), flush=True)

    return say


def to_stderr(text: str) -> None:
    """Progress that never mixes with the report: a line on stderr, at once."""
    print(text, file=sys.stderr, flush=True)
