"""The campaign's report as rich tables (one per API) and as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from servemesh.fuzz.campaign import CampaignReport
from servemesh.fuzz.rpcs import RPCS

APIS = ("gateway", "model", "feature", "registry")


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):+.1f} MiB"


def print_report(report: CampaignReport, console: Console) -> None:
    for api in APIS:
        processes = [n for n, s in report.services.items() if s == api]
        crashes = sum(1 for n in processes if n in report.dead)
        growth = max((report.rss_growth.get(n, 0) for n in processes), default=0)
        table = Table(
            title=f"{api}: {crashes} crashed of {len(processes)} processes, "
            f"max RSS growth {_mib(growth)}",
            title_justify="left",
        )
        for column in ("rpc", "control", "requests", "envoy / direct", "statuses", "findings"):
            table.add_column(column, overflow="fold")
        for rpc in (r for r in RPCS if r.api == api):
            tally = report.rpcs.get(rpc.name)
            if tally is None:
                continue
            found = sum(f.count for f in report.findings if f.rpc == rpc.name)
            table.add_row(
                rpc.name,
                "yes" if rpc.control else "",
                str(tally.requests),
                f"{tally.by_via['envoy']} / {tally.by_via['direct']}",
                ", ".join(f"{code} {n}" for code, n in tally.statuses.most_common()),
                str(found),
            )
        console.print(table)
    envoy_growth = report.rss_growth.get("envoy", 0)
    console.print(
        f"{report.requests} requests in {report.duration_s:.0f} s (seed {report.seed}); "
        f"Envoy RSS growth {_mib(envoy_growth)}; "
        f"valid Predicts: {report.valid_sent} sent, {len(report.valid_failures)} failed"
    )
    for name, pid in sorted(report.dead.items()):
        console.print(f"[red]process died: {name} (pid {pid})[/red]")
    for name, growth in sorted(report.over_bound().items()):
        console.print(f"[red]RSS of {name} grew {_mib(growth)}[/red]")
    for failure in report.valid_failures[:10]:
        console.print(f"[red]valid Predict failed: {failure}[/red]")
    for finding in report.findings:
        console.print(
            f"[red]{finding.kind}[/red] {finding.rpc} via {finding.via}: "
            f"{finding.code} {finding.details[:200]!r} x{finding.count}"
        )
    verdict = "[green]no findings[/green]" if report.ok else "[red]findings above[/red]"
    console.print(verdict)


def write_json(report: CampaignReport, path: Path) -> None:
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
