"""docs/cli.md, generated from the parser: every command, its flags and the exit statuses.

python -m servemesh.cli.reference > docs/cli.md     # write the page
python -m servemesh.cli.reference --check           # exit 1 when the page is stale
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from servemesh.cli import build_parser
from servemesh.cli.mesh import STATE_DIR_ENV
from servemesh.contract.errors import EXIT_CODES, NoMesh

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
WIDTH = 100

HEADER = f"""# The servemesh command line

Generated from the parser by `python -m servemesh.cli.reference > docs/cli.md`; a test
fails when this page and the parser disagree (`python -m servemesh.cli.reference --check`).

Every command that talks to a running mesh takes `--state-dir` and `--spec` after its own
name (a command group takes them before its subcommand too: `servemesh models --state-dir D
list` and `servemesh models list --state-dir D` are the same). The state dir is
`--state-dir`, else `${STATE_DIR_ENV}`, else the spec's (`--spec`, else `./mesh.yaml`, else
the built-in `.servemesh`). With no mesh there, every such command prints one line and
exits 5 (2 before this release):

    error: {NoMesh("DIR")}

One mesh runs from a state dir at a time: `servemesh up` holds it (`mesh.lock` there) until
the mesh stops, and a second `up` on it is refused with exit 4, naming the running mesh's
PID and edge; a lock left by a mesh that was killed is taken over, saying so.
`servemesh status` shows the mesh a state dir names (its endpoints, PIDs and health) and
`servemesh down` stops it, from any shell.

`servemesh log`, `servemesh trace` and `servemesh rollout status|history|pause` still read
what a stopped mesh recorded in its state dir (prediction log, traces, rollouts).

## Exit statuses

Kept by every command (servemesh/contract/errors.py); an error is one line on stderr,
`error: ...` (or `refused: ...` for a refused change, `models push: ...` and the like
where the command names itself).

| status | meaning |
|---|---|
"""

CHANGES = """
## Changes

- One vocabulary (servemesh/cli/flags.py): `--rate` is a target rate with its unit in the
  help (`capacity plan --rps` is `--rate`, `--start-rps` is `--start-rate`; `bench profile
  --rate` is `--sample-rate`); `--slo` is the one SLO flag, a duration (`--slo 250ms`; was
  `--slo-ms`, `--p99-ms`); durations read `30s`, `5m`, `1h30m`, `250ms` (a bare number is
  seconds): `--seconds` is `--duration`, `--idle-seconds` is `--idle`, `--step-s` is
  `--step`, `scale forecast --hours N` is `--span Nh`, and `--timeout`, `--interval`,
  `--window` take the same syntax; `--out` names only what a command writes (`batch score
  --entities FILE` is `--entity-ids FILE`, `registry snapshots --out DIR` is
  `--backup-dir DIR`); every command that prints data takes `-o json|table` (`--json` is
  `-o json`). An old spelling works for one more release and says, in one line on stderr,
  which flag replaces it.
- No running mesh exits 5 (it was 2, which stays for usage errors alone).

- `servemesh routes apply FILE` is `servemesh apply FILE` now: one code path for applying a
  file (a routing-only change is a mesh file whose models and views are the running ones).
  `routes apply` stays as an alias that says where it went.
- `--state-dir` and `--spec` are taken after every command's own name, and
  `SERVEMESH_STATE_DIR` is the fallback.
- Exit statuses follow the table above: `load` exits 1 (was 3) when calls failed;
  `auth token`, `compose init`, `chaos run` and `predict --token-file` refuse bad input
  with 1 (was 2); `log query` and `trace` with no mesh and nothing recorded exit 2 (an
  empty table or 1 before); `top --once` with no mesh exits 2 (a traceback before).
- `servemesh up` refuses a state dir a running mesh holds (exit 4; it used to start a
  second mesh there, which broke the first); `servemesh status` and `servemesh down` are
  new; `predict --json` names the tier that answered (`"tier"`).
"""


def _fixed(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
    return parser


def _subcommands(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        metavar = action.metavar if isinstance(action.metavar, str) else None
        names = ", ".join(action.option_strings) or metavar or action.dest
        if action.option_strings and action.nargs != 0:
            names += f" {metavar or action.dest.upper()}"
        what = (action.help or "").replace("%%", "%").replace("|", "\\|")
        if action.choices is not None and not isinstance(action.choices, dict):
            what += f" (one of: {', '.join(str(c) for c in action.choices)})"
        if action.required and action.option_strings:
            what += " (required)"
        rows.append(f"| `{names}` | {what.strip()} |")
    return rows


def _section(path: list[str], help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"{'#' * min(len(path) + 1, 4)} `servemesh {' '.join(path)}`", ""]
    if help_text:
        lines += [help_text.replace("%%", "%"), ""]
    usage = _fixed(parser).format_usage().removeprefix("usage: ").rstrip()
    lines += ["```", usage, "```", ""]
    rows = _flag_rows(parser)
    if rows:
        lines += ["| argument | meaning |", "|---|---|", *rows, ""]
    for name, sub_help, sub in _subcommands(parser):
        lines += _section([*path, name], sub_help, sub)
    return lines


def render() -> str:
    parser = _fixed(build_parser())
    lines = [HEADER.rstrip("\n")]
    lines += [f"| {code} | {meaning} |" for code, meaning in EXIT_CODES.items()]
    lines += ["", "## Commands", ""]
    lines += [f"- `{name}`: {help_text}" for name, help_text, _ in _subcommands(parser)]
    lines.append("")
    for name, help_text, sub in _subcommands(parser):
        lines += _section([name], help_text, sub)
    return "\n".join(lines).rstrip("\n") + "\n" + CHANGES


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(prog="python -m servemesh.cli.reference")
    args.add_argument("--check", action="store_true", help=f"compare with {PAGE.name}")
    if not args.parse_args(argv).check:
        sys.stdout.write(render())
        return 0
    if PAGE.is_file() and PAGE.read_text() == render():
        return 0
    sys.stderr.write(f"{PAGE} is stale: python -m servemesh.cli.reference > docs/cli.md\n")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
