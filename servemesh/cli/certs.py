"""`servemesh certs`: the running mesh's certificates, and replacing them without a stop.

servemesh certs show              # identity, serial, expiry, generation
servemesh certs rotate            # a new certificate for every identity, live
servemesh certs rotate envoy gateway-zone-a-0
"""

from __future__ import annotations

import argparse
import datetime as dt
import json

from rich.table import Table

from servemesh.cli.flags import add_output
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out
from servemesh.contract.errors import UsageError
from servemesh.identity.enroll import edge_names, issuing, mesh_identity
from servemesh.spec import ResolvedSpec


def _running(args: argparse.Namespace) -> ResolvedSpec:
    return running_mesh(args).spec


def cmd_show(args: argparse.Namespace) -> int:
    spec = _running(args)
    identity = mesh_identity(spec)
    now = dt.datetime.now(dt.UTC)
    rows = []
    for name in identity.identities():
        cert = identity.leaf(name).read().certificate
        rows.append(
            {
                "identity": name,
                "generation": identity.current(name).readlink().name,
                "serial": f"{cert.serial_number:x}"[:16],
                "expires": cert.not_valid_after_utc.isoformat(timespec="seconds"),
                "days_left": round((cert.not_valid_after_utc - now).total_seconds() / 86400, 1),
            }
        )
    if args.json:
        out.print_json(json.dumps({"trust": str(identity.trust_file), "identities": rows}))
        return 0
    table = Table(title=f"certificates of {spec.name} (trust: {identity.trust_file})")
    for column in ("identity", "generation", "serial", "expires", "days left"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    out.print(table)
    return 0


def cmd_rotate(args: argparse.Namespace) -> int:
    spec = _running(args)
    identity = mesh_identity(spec)
    known = identity.identities()
    chosen = args.identities or known
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise UsageError(f"no certificate for {', '.join(unknown)}; known: {known}")
    extra = edge_names(spec)
    with issuing(identity):
        for name in chosen:
            generation = identity.rotate(
                name, days=spec.tls.leaf_days, extra_names=extra.get(name, ())
            )
            out.print(f"{name}: {generation.name}")
    # Servers show the new certificate from their next handshake, Envoy once it re-reads
    # its SDS files, and the gateways dial again within seconds; open connections go on.
    out.print(f"rotated {len(chosen)} certificate(s); connections already open are kept")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    certs = sub.add_parser("certs", help="the mesh's TLS certificates: show them, rotate them")
    add_mesh_flags(certs)
    verbs = certs.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", help="every identity's certificate: serial and expiry")
    add_mesh_flags(show, inherited=True)
    add_output(show)
    show.set_defaults(func=cmd_show)
    rotate = verbs.add_parser(
        "rotate", help="issue new certificates and swap them in live (default: every identity)"
    )
    add_mesh_flags(rotate, inherited=True)
    rotate.add_argument("identities", nargs="*", metavar="IDENTITY")
    rotate.set_defaults(func=cmd_rotate)
