"""`servemesh models show MODEL` (no version) and `servemesh models release MODEL VERSION`:
the versions quarantined because their calls kept crashing their model servers, and the
crashes recorded with the calls in flight (servemesh/quarantine.py).

Read from the running mesh's state dir: `quarantine.json` (the list) and `crashes.jsonl`
(what the launcher recorded at each crash). `release` takes a version off the list and
moves no traffic: the operator gives it traffic again with `servemesh routes set` or
`servemesh apply`. `models show MODEL VERSION` shows the same for one version
(`version_section`).
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out, write
from servemesh.contract.errors import ServemeshError
from servemesh.quarantine import (
    QuarantineState,
    crashes_of,
    natural_key,
    read_crashes,
    release,
)

# The crashes a show lists, newest last (crashes.jsonl keeps them all).
SHOWN_CRASHES = 20


class QuarantineError(ServemeshError):
    """The command was refused; the message is one line naming why."""


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")


def version_facts(state_dir: Path, model: str, version: str) -> dict[str, Any]:
    """One version's quarantine state and its crashes, as `--json` prints them."""
    entry = QuarantineState.read(state_dir).quarantined.get((model, version))
    crashes = crashes_of(read_crashes(state_dir), model, version)
    return {
        "quarantined": entry is not None,
        "quarantine": entry,
        "crashes": [_crash_json(c, model, version) for c in crashes],
    }


def _crash_json(record: Mapping[str, Any], model: str, version: str | None) -> dict[str, Any]:
    calls = [
        c
        for c in record.get("inflight", ())
        if c.get("model") == model and (version is None or c.get("version") == version)
    ]
    return {
        "time": record.get("time"),
        "instance": record.get("instance"),
        "pool": record.get("pool"),
        "exit": record.get("exit"),
        "exit_text": record.get("exit_text"),
        "calls": calls,
    }


def _state_text(entry: Mapping[str, Any] | None) -> str:
    if entry is None:
        return "no"
    since = _when(float(entry.get("since", 0)))
    return f"yes, since {since}; its traffic went to {entry.get('traffic_to', '-')}"


def _crash_table(crashes: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title=f"crashes with its calls in flight ({len(crashes)})", title_justify="left")
    for column in ("when", "instance", "exit", "version", "request id", "caller", "payload sha256"):
        table.add_column(column, overflow="fold")
    for crash in crashes[-SHOWN_CRASHES:]:
        for index, call in enumerate(crash["calls"]):
            head = (
                (_when(float(crash["time"])), str(crash["instance"]), str(crash["exit_text"]))
                if index == 0
                else ("", "", "")
            )
            table.add_row(
                *head,
                str(call.get("version", "")),
                str(call.get("request_id", "")),
                str(call.get("caller", "")),
                str(call.get("sha256", "")),
            )
    return table


def version_section(state_dir: Path, model: str, version: str) -> None:
    """What `models show MODEL VERSION` prints after the version's facts."""
    facts = version_facts(state_dir, model, version)
    out.print(f"quarantined: {_state_text(facts['quarantine'])}", highlight=False, markup=False)
    if facts["crashes"]:
        out.print(_crash_table(facts["crashes"]))


def cmd_show_model(args: argparse.Namespace) -> int:
    """`models show MODEL`: each version's weight and quarantine state, and the crashes
    that had the model's calls in flight."""
    mesh = running_mesh(args)
    entry = mesh.spec.models.get(args.model)
    state = QuarantineState.read(mesh.state_dir)
    crashes = [
        _crash_json(c, args.model, None)
        for c in crashes_of(read_crashes(mesh.state_dir), args.model)
    ]
    versions = sorted(entry.versions if entry else {}, key=natural_key)
    known = {v for m, v in state.quarantined if m == args.model}
    if entry is None and not known and not crashes:
        raise QuarantineError(
            f"model {args.model!r} is not served; served: {sorted(mesh.spec.models)}"
        )
    rows: list[dict[str, Any]] = [
        {
            "version": version,
            "weight": entry.traffic.get(version, 0) if entry else None,
            "quarantine": state.quarantined.get((args.model, version)),
        }
        for version in sorted(set(versions) | known, key=natural_key)
    ]
    if args.json:
        write(json.dumps({"model": args.model, "versions": rows, "crashes": crashes}))
        return 0
    table = Table(title=args.model, title_justify="left")
    for column in ("version", "weight", "quarantined"):
        table.add_column(column)
    for row in rows:
        weight = "-" if row["weight"] is None else f"{row['weight']}%"
        table.add_row(row["version"], weight, _state_text(row["quarantine"]))
    out.print(table)
    if crashes:
        out.print(_crash_table(crashes))
    else:
        out.print("no crash recorded with its calls in flight", highlight=False, markup=False)
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    try:
        entry = release(mesh.state_dir, args.model, args.version)
    except KeyError:
        listed = sorted(f"{m} {v}" for m, v in QuarantineState.read(mesh.state_dir).quarantined)
        raise QuarantineError(
            f"{args.model} {args.version} is not quarantined; quarantined: {listed or 'none'}"
        ) from None
    out.print(
        f"{args.model} {args.version}: released from quarantine (its traffic had gone to "
        f"{entry.get('traffic_to', '-')}). Traffic was not moved back: give it traffic again "
        f"with `servemesh routes set {args.model} ...` or `servemesh apply FILE`.",
        highlight=False,
        markup=False,
    )
    return 0


def register(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`models release` (`models show MODEL` without a version is `show`'s own)."""
    release_ = verbs.add_parser(
        "release",
        help="take a quarantined version off the quarantine list; moves no traffic back "
        "(then `routes set` or `apply`)",
    )
    add_mesh_flags(release_, inherited=True)
    release_.add_argument("model")
    release_.add_argument("version")
    release_.set_defaults(func=cmd_release, error_label="models release")
