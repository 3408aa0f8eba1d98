"""The command line's vocabulary: a flag means one thing in every command that takes it.

- `--rate`: a target rate, its unit in the help (Predicts/s, events/s).
- `--slo`: the p99 latency objective, a duration (`250ms`).
- `--duration`, `--idle`, `--step`, `--interval`, `--window`, `--span`, `--timeout`: one
  duration syntax, `30s`, `5m`, `1h30m`, `250ms`; a bare number is seconds.
- `--out`: where a command writes (a file, a folder, a store); what it reads is named for
  what it is (`--entity-ids FILE`, `--backup-dir DIR`).
- `-o json|table`: how a command that prints data prints it (`--json` is `-o json`).

An old spelling keeps working for one release: it is hidden from the help and says, in one
line on stderr, which flag replaces it (`deprecated`). tests/unit/test_cli_vocabulary.py
holds every flag to one meaning.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import Any

from servemesh.cli.output import console

DURATION_HELP = "a duration: 30s, 5m, 1h30m, 250ms (a bare number is seconds)"
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def duration(text: str) -> float:
    """Seconds in `30s`, `5m`, `1h30m`, `250ms`; a bare number is seconds (`2.5`)."""
    given = text.strip()
    if _NUMBER.fullmatch(given):
        return float(given)
    parts = _PART.findall(given)
    if not parts or "".join(n + u for n, u in parts) != given:
        raise argparse.ArgumentTypeError(f"{text!r} is not {DURATION_HELP}")
    return sum(float(n) * _UNIT_S[unit] for n, unit in parts)


def duration_ms(text: str) -> float:
    """Milliseconds in a duration; a bare number is milliseconds (`--slo 250`)."""
    given = text.strip()
    if _NUMBER.fullmatch(given):
        return float(given)
    return duration(given) * 1000.0


def output_choice(text: str) -> bool:
    """`-o json` is True (print JSON), `-o table` False."""
    if text not in OUTPUT_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(OUTPUT_FORMATS)}")
    return text == "json"


OUTPUT_FORMATS = ("json", "table")


def add_output(parser: argparse.ArgumentParser, json_help: str = "print as JSON") -> None:
    """`-o json|table` (default table) and `--json`, its alias: both set `args.json`."""
    parser.add_argument(
        "-o",
        "--output",
        dest="json",
        type=output_choice,
        default=False,
        metavar="{json,table}",
        help=f"json: {json_help}; table: for people (default)",
    )
    parser.add_argument("--json", action="store_true", help="the same as -o json")


def add_rate(parser: argparse.ArgumentParser, unit: str, help: str, **kwargs: Any) -> None:
    """`--rate`, a target rate: `unit` is what it counts a second (Predicts/s, events/s)."""
    kwargs.setdefault("type", float)
    parser.add_argument("--rate", help=f"{help} ({unit})", **kwargs)


def add_duration(
    parser: argparse.ArgumentParser, flag: str, help: str, *, dest: str, **kwargs: Any
) -> None:
    """A duration flag (`30s`, `5m`; a bare number is seconds): seconds in `args.<dest>`."""
    parser.add_argument(flag, dest=dest, type=duration, metavar="DURATION", help=help, **kwargs)


def add_slo(parser: argparse.ArgumentParser, **kwargs: Any) -> None:
    """`--slo`, the p99 objective: milliseconds in `args.slo_ms`."""
    parser.add_argument(
        "--slo",
        dest="slo_ms",
        type=duration_ms,
        metavar="DURATION",
        help="the SLO: p99 at most, a duration (250ms, 1s; a bare number is ms)",
        **kwargs,
    )


class _Deprecated(argparse.Action):
    """An old spelling: stores what the new flag would, and says so on stderr."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        instead: str,
        convert: Callable[[str], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.instead = instead
        self.convert = convert
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        console.print(
            f"note: {option_string} is deprecated and goes in the next release; use {self.instead}",
            markup=False,
        )
        if self.nargs == 0:
            values = self.const
        elif self.convert is not None:
            try:
                values = self.convert(values)
            except (TypeError, ValueError) as exc:
                parser.error(f"argument {option_string}: invalid value: {values!r} ({exc})")
        setattr(namespace, self.dest, values)


def deprecated(
    parser: argparse.ArgumentParser,
    old: str,
    instead: str,
    *,
    dest: str,
    convert: Callable[[str], Any] | None = None,
    flag: bool = False,
) -> None:
    """`old` still works for one release, as `instead` does (hidden from the help):
    `convert` reads its value the old way (`--seconds 5`, `--p99-ms 250`)."""
    extra: dict[str, Any] = {"nargs": 0, "const": True} if flag else {"convert": convert}
    parser.add_argument(
        old,
        dest=dest,
        action=_Deprecated,
        instead=instead,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **extra,
    )


__all__ = [
    "DURATION_HELP",
    "OUTPUT_FORMATS",
    "add_duration",
    "add_output",
    "add_rate",
    "add_slo",
    "deprecated",
    "duration",
    "duration_ms",
]


def add_gate_overrides(
    parser: argparse.ArgumentParser,
    override_help: str = "let a failed gate through: freeze or error_budget (each with its "
    "own --reason)",
) -> None:
    """`--override ITEM --reason TEXT` (each repeatable, paired in order) on a command that
    changes what a model serves: a freeze or a spent error budget refuses it otherwise
    (servemesh.rollout.change_gates); `rollout start` takes its checklist's items too."""
    parser.add_argument("--override", action="append", metavar="ITEM", help=override_help)
    parser.add_argument("--reason", action="append", metavar="TEXT", help="why (recorded)")
