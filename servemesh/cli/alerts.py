"""`servemesh alerts`: what pages and tickets now, and what was sent lately.

Firing alerts come from the mesh's Alertmanager (its API, `/api/v2/alerts`); the recent
ones from the mesh's own receiver, which keeps every notification Alertmanager sent it,
firing and resolved (servemesh/observe/alert_receiver.py). Each with its severity, the
model and objective it is about (or the feature, for a drift alert), and its runbook.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from rich.table import Table

from servemesh.cli.flags import add_output
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out, write
from servemesh.contract.errors import ServemeshError
from servemesh.observe.alert_receiver import read_received

RECENT = 20


def firing(address: str) -> list[dict[str, Any]]:
    """The alerts Alertmanager holds active now (not silenced or inhibited)."""
    url = f"http://{address}/api/v2/alerts?active=true&silenced=false&inhibited=false"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            found = json.loads(reply.read())
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise ServemeshError(f"Alertmanager at {address} did not answer: {exc}") from None
    return [
        {
            "alert": a["labels"].get("alertname", ""),
            "severity": a["labels"].get("severity", ""),
            "model": a["labels"].get("model", ""),
            "objective": a["labels"].get("objective", ""),
            "feature": a["labels"].get("feature", ""),
            "since": a.get("startsAt", ""),
            "summary": a.get("annotations", {}).get("summary", ""),
            "runbook": a.get("annotations", {}).get("runbook", ""),
        }
        for a in found
    ]


def recent(received: list[dict[str, Any]], limit: int = RECENT) -> list[dict[str, Any]]:
    """The receiver's last notifications, newest first."""
    rows = []
    for sent in reversed(received[-limit:]):
        labels = sent.get("labels") or {}
        rows.append(
            {
                "status": sent.get("status", ""),
                "alert": labels.get("alertname", ""),
                "severity": labels.get("severity", ""),
                "model": labels.get("model", ""),
                "objective": labels.get("objective", ""),
                "feature": labels.get("feature", ""),
                "received": sent.get("received"),
                "runbook": (sent.get("annotations") or {}).get("runbook", ""),
            }
        )
    return rows


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    if any(row.get("feature") for row in rows):  # a drift alert's: which feature moved
        columns = [
            *columns[: columns.index("objective") + 1],
            "feature",
            *columns[columns.index("objective") + 1 :],
        ]
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    return table


def cmd_alerts(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    address = mesh.endpoints().get("alertmanager")
    if not address:
        raise ServemeshError(
            "this mesh runs no Alertmanager (metrics.alertmanager off, no Prometheus, or no "
            "alertmanager binary: apt-get install prometheus-alertmanager)"
        )
    now = firing(str(address))
    lately = recent(read_received(mesh.state_dir))
    if args.json:
        write(json.dumps({"firing": now, "recent": lately}))
        return 0
    columns = ["alert", "severity", "model", "objective", "since", "runbook"]
    out.print(_table(f"firing ({len(now)})", now, columns))
    recent_columns = ["status", "alert", "severity", "model", "objective", "runbook"]
    out.print(_table("recent notifications (newest first)", lately, recent_columns))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    alerts = sub.add_parser(
        "alerts", help="alerts firing now (Alertmanager) and the notifications sent lately"
    )
    add_mesh_flags(alerts)
    add_output(alerts)
    alerts.set_defaults(func=cmd_alerts)
