"""One vocabulary on the command line (servemesh/cli/flags.py): a flag two commands take
means the same in both, durations read one syntax, every command that prints data takes
`-o json`, and an old spelling still works for a release, saying what replaces it."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.cli import build_parser, main
from servemesh.cli.flags import _Deprecated, duration, duration_ms
from servemesh.contract.errors import EXIT_CODES, NO_MESH, USAGE


def _leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(path), parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, (*path, name))


LEAVES = dict(_leaves(build_parser()))

# Each flag more than one command takes, and the one meaning it has: where the value goes
# and how it is read. `--rate` also names its unit in the help (one of RATE_UNITS).
MEANINGS: dict[str, tuple[str, str]] = {
    "--state-dir": ("state_dir", "str"),
    "--spec": ("spec", "str"),
    "-o": ("json", "output_choice"),
    "--output": ("json", "output_choice"),
    "--json": ("json", "flag"),
    "--json-out": ("json_out", "str"),
    "--out": ("out", "str"),
    "--rate": ("rate", "float"),
    "--slo": ("slo_ms", "duration_ms"),
    "--duration": ("seconds", "duration"),
    "--idle": ("idle_seconds", "duration"),
    "--timeout": ("timeout", "duration"),
    "--entities": ("entities", "int"),
    "--entity-ids": ("entity_ids", "str"),
    "--model": ("model", "str"),
    "--version": ("version", "str"),
    "--alias": ("alias", "str"),
    "--entity": ("entity", "str"),
    "--address": ("address", "str"),
    "--concurrency": ("concurrency", "int"),
    "--repeats": ("repeats", "int"),
    "--seed": ("seed", "int"),
    "--limit": ("limit", "int"),
    "--since": ("since", "str"),
    "--reason": ("reason", "str"),
    "--override": ("override", "str"),
    "--view": ("view", "str"),
    "--format": ("format", "str"),
    "--atol": ("atol", "float"),
    "--rtol": ("rtol", "float"),
    "--pool": ("pool", "str"),
    "--name": ("name", "str"),
    "--plan": ("plan", "str"),
    "--top": ("top", "int"),
    "--slowest": ("slowest", "str"),
    "--batch-size": ("batch_size", "int"),
    "--chunk-rows": ("chunk_rows", "int"),
    "--threads": ("threads", "int"),
    "--through-mesh": ("through_mesh", "flag"),
    "--progress": ("progress", "str"),
    "--now": ("now", "str"),
    "--job": ("job", "str"),
    "--client": ("client", "str"),
    "--rows": ("rows", "int"),
    "--width": ("width", "int"),
    "--window": ("window", "duration"),
    "--reference": ("reference", "str"),
}
# Where a flag keeps its meaning under another dest or type, and why.
SAME_MEANING = {
    ("check", "--spec"): "the spec, as a flag; the positional SPEC holds the dest `spec`",
    ("trace", "--slowest"): "the slowest N, as `log query --slowest N` (a share there too)",
}
RATE_UNITS = ("Predicts/s", "requests/s", "events/s")
# Flags whose value is a duration: `30s`, `5m`; a bare number is seconds.
DURATIONS = {"--duration", "--idle", "--timeout", "--interval", "--window", "--step", "--span"}
# Commands that print what they did (or a token, a config), not data.
NOT_DATA = {
    "up", "down", "check", "routes set", "routes apply", "routes rollback", "routes shadow",
    "fleet retire", "fleet discard", "rollout start", "rollout pause", "rollout resume",
    "rollout abort", "rollout promote", "apply", "models push", "models alias",
    "models export", "models quantize", "models release", "models load", "models unload",
    "edge sync", "certs rotate", "auth token", "chaos run", "features load",
    "stream consume", "stream send", "control-plane", "compose init", "compose probe",
    "compose seed", "compose consul-acl", "envoy-config", "batch score", "batch run-due",
    "batch run", "cache flush", "scale run",
}  # fmt: skip


def _kind(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "flag"
    kind = action.type
    return "str" if kind is None else getattr(kind, "__name__", str(kind))


def _shown(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        for flag in action.option_strings:
            yield flag, action


def test_no_two_commands_give_a_flag_different_meanings() -> None:
    users: dict[str, list[str]] = {}
    wrong = []
    for name, parser in LEAVES.items():
        for flag, action in _shown(parser):
            users.setdefault(flag, []).append(name)
            meant = MEANINGS.get(flag)
            if meant and (action.dest, _kind(action)) != meant and (name, flag) not in SAME_MEANING:
                wrong.append(f"{name} {flag}: {(action.dest, _kind(action))} != {MEANINGS[flag]}")
            if flag == "--rate" and not any(f"({u})" in (action.help or "") for u in RATE_UNITS):
                wrong.append(f"{name} --rate: no unit in its help ({action.help!r})")
            if flag in DURATIONS and _kind(action) != "duration":
                wrong.append(f"{name} {flag}: not read as a duration")
    shared = {flag for flag, names in users.items() if len(names) > 1}
    assert sorted(shared - set(MEANINGS)) == [], "a shared flag with no meaning in MEANINGS"
    assert wrong == []


def test_the_vocabulary_words_that_left() -> None:
    # What a flag used to mean in one command and another, shown nowhere now.
    gone = {"--rps", "--p99-ms", "--slo-ms", "--seconds", "--idle-seconds", "--step-s", "--hours"}
    for name, parser in LEAVES.items():
        assert not gone & {flag for flag, _ in _shown(parser)}, name
    assert "--entities" not in dict(_shown(LEAVES["batch score"]))
    assert "--out" not in dict(_shown(LEAVES["registry snapshots"]))


def test_every_data_command_takes_o_json() -> None:
    unsorted = set(LEAVES) - NOT_DATA
    for name in sorted(unsorted):
        flags = LEAVES[name]._option_string_actions
        assert "-o" in flags and "--output" in flags, f"{name} prints data: give it -o json"
        assert _kind(flags["-o"]) == "output_choice" and "--json" in flags, name
    assert len(unsorted) >= 25


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["-o", "json"], True),
        (["--output", "table"], False),
        (["--json"], True),
        ([], False),
    ],
)
def test_o_json_and_its_alias(argv: list[str], want: bool) -> None:
    args = build_parser().parse_args(["routes", "show", *argv])
    assert args.json is want


PLAN = ["capacity", "plan", "--rate", "4", "--slo", "1s"]
SCORE = ["batch", "score", "--model", "m", "--out", "x.parquet"]


def test_one_duration_syntax() -> None:
    assert duration("30s") == 30 and duration("5m") == 300 and duration("1h30m") == 5400
    assert duration("250ms") == 0.25 and duration("2.5") == 2.5 and duration("1d") == 86400
    assert duration_ms("250ms") == 250 and duration_ms("1s") == 1000 and duration_ms("80") == 80
    for bad in ("", "5x", "m5", "5 m", "-1s"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration(bad)


@pytest.mark.parametrize(
    ("argv", "old", "dest", "value"),
    [
        (["load", "--seconds", "5"], "--seconds", "seconds", 5.0),
        (["load", "--duration", "5m"], None, "seconds", 300.0),
        (["capacity", "plan", "--rps", "40", "--slo", "80"], "--rps", "rate", 40.0),
        (["capacity", "plan", "--rate", "40", "--p99-ms", "80"], "--p99-ms", "slo_ms", 80.0),
        (["capacity", "plan", "--rate", "40", "--slo", "80ms"], None, "slo_ms", 80.0),
        ([*PLAN, "--step-s", "3"], "--step-s", "step_s", 3.0),
        ([*PLAN, "--step", "1m"], None, "step_s", 60.0),
        ([*PLAN, "--start-rps", "9"], "--start-rps", "start_rate", 9.0),
        (["bench", "scale", "--slo-ms", "120"], "--slo-ms", "slo_ms", 120.0),
        (["bench", "layout", "--idle-seconds", "3"], "--idle-seconds", "idle_seconds", 3.0),
        (["bench", "profile", "--rate", "50"], "--rate", "rate", 50),
        (["scale", "forecast", "--hours", "3"], "--hours", "span", 3 * 3600.0),
        (["scale", "forecast", "--span", "3h"], None, "span", 3 * 3600.0),
        ([*SCORE, "--entities", "ids.csv"], "--entities", "entity_ids", "ids.csv"),
        (["registry", "snapshots", "--out", "backups"], "--out", "backup_dir", "backups"),
        (["top", "--interval", "1"], None, "interval", 1.0),
        (["predict", "--model", "m", "--timeout", "500ms"], None, "timeout", 0.5),
    ],
)  # fmt: skip
def test_old_spellings_work_for_a_release_saying_what_replaces_them(
    argv: list[str],
    old: str | None,
    dest: str,
    value: object,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    said = capsys.readouterr().err.splitlines()
    if old is None:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(f"note: {old} is deprecated"), said


def test_old_spellings_are_deprecated_actions_hidden_from_the_help() -> None:
    hidden = {
        flag
        for parser in LEAVES.values()
        for action in parser._actions
        if isinstance(action, _Deprecated)
        for flag in action.option_strings
    }
    assert {"--rps", "--p99-ms", "--slo-ms", "--seconds", "--hours", "--entities"} <= hidden
    for parser in LEAVES.values():
        for action in parser._actions:
            if isinstance(action, _Deprecated):
                assert action.help == argparse.SUPPRESS


def test_no_running_mesh_has_its_own_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert NO_MESH not in (USAGE, 0, 1) and NO_MESH in EXIT_CODES
    assert main(["fleet", "show", "--state-dir", str(tmp_path), "-o", "json"]) == NO_MESH
    assert "no running mesh" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["fleet", "show", "--no-such-flag"])
    assert usage.value.code == USAGE


def test_commands_print_through_the_output_module() -> None:
    cli = Path(__file__).resolve().parents[2] / "servemesh" / "cli"
    raw = []
    for path in sorted(cli.glob("*.py")):
        if path.name in {"output.py", "reference.py"}:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if (
                "sys.stdout.write" in code
                or "sys.stderr.write" in code
                or ("print(" in code and ".print(" not in code and "print_" not in code)
            ):
                raw.append(f"{path.name}:{number}: {line.strip()}")
    assert raw == []
