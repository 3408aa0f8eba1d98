"""`servemesh fuzz`: start a mesh of its own on free ports, fuzz it, print and save the report."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from servemesh.cli.flags import add_duration, add_output
from servemesh.cli.output import out as console
from servemesh.cli.output import write
from servemesh.contract.errors import ServemeshError
from servemesh.spec import Ports, load_spec


def register(sub: Any) -> None:
    fuzz = sub.add_parser(
        "fuzz",
        help="fuzz every public RPC of a fresh mesh (through Envoy and directly) and report",
    )
    fuzz.add_argument("--requests", type=int, default=10_000, help="generated requests in all")
    fuzz.add_argument("--seed", type=int, default=0, help="hypothesis seed (reproducible runs)")
    fuzz.add_argument("--spec", help="mesh spec (default: ./mesh.yaml, else built-in defaults)")
    add_duration(
        fuzz, "--timeout", "each request's deadline (default 5s)", dest="timeout", default=5.0
    )
    add_output(fuzz, "print the report as JSON")
    fuzz.add_argument("--json-out", help="also write the report here")
    fuzz.set_defaults(func=cmd_fuzz)


def cmd_fuzz(args: argparse.Namespace) -> int:
    try:
        from servemesh.fuzz.campaign import run_campaign
        from servemesh.fuzz.report import print_report, write_json
    except ImportError as exc:  # hypothesis comes with the test extras
        raise ServemeshError(f"{exc}: install servemesh[test]") from None
    from servemesh.launcher import Mesh

    spec = load_spec(args.spec)
    spec = spec.model_copy(update={"ports": Ports.free()})
    with tempfile.TemporaryDirectory(prefix="servemesh-fuzz-") as state:
        with Mesh.from_spec(spec, Path(state)) as mesh:
            console.print(f"mesh up; fuzzing with {args.requests} requests, seed {args.seed}")

            def progress(sent: int) -> None:
                if sent % 1000 == 0:
                    console.print(f"  {sent} sent")

            report = run_campaign(
                mesh, args.requests, args.seed, timeout_s=args.timeout, on_progress=progress
            )
    if args.json:
        write(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report, console)
    if args.json_out:
        write_json(report, Path(args.json_out))
    return 0 if report.ok else 1
