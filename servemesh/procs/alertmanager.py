"""The mesh's Alertmanager and the webhook receiver it notifies: started beside the mesh's
Prometheus when an `alertmanager` binary is installed (Debian's `prometheus-alertmanager`),
stopped by PID like every other child.

Prometheus evaluates the alerts of servemesh.slo_rules and the cost rule and sends them
here; Alertmanager groups them and routes by severity: `page` and `ticket` to the mesh's own
receiver (servemesh.observe.alert_receiver, which keeps every notification for `servemesh
alerts`), each also to the webhooks the spec names for it (`metrics.alert_webhooks`).
Resolved alerts are sent too. Clustering is off (one Alertmanager per mesh), its state under
`<state_dir>/alertmanager`, its API on loopback.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.private import private_dir
from servemesh.contract.yaml_text import dump_yaml
from servemesh.procs.ready import Check, answers_ok
from servemesh.procs.supervisor import Child, Supervisor
from servemesh.spec import ResolvedSpec, free_port

NAME = "alertmanager"
RECEIVER_NAME = "alert-receiver"
# The severities the mesh's alerts carry, each a route and a receiver of that name.
SEVERITIES = ("page", "ticket")


def alertmanager_binary() -> str | None:
    """Alertmanager on PATH: upstream's name, or Debian's package's."""
    return shutil.which("alertmanager") or shutil.which("prometheus-alertmanager")


def _seconds(value: float) -> str:
    return f"{max(1, round(value))}s"


def render_config(spec: ResolvedSpec, receiver_url: str) -> dict[str, Any]:
    """Routes by severity, each to the mesh's receiver (its path names the severity) and to
    the spec's webhooks for it; anything else to the mesh's receiver alone. Grouped by
    alert and model, first sent a couple of scrapes after it fires, and again (resolved,
    or changed) every few scrapes: a local mesh's timings, from its scrape interval."""
    scrape = spec.metrics.scrape_interval_s
    hooks: dict[str, list[str]] = {str(k): v for k, v in spec.metrics.alert_webhooks.items()}

    def receiver(name: str) -> dict[str, Any]:
        urls = [f"{receiver_url}/{name}", *hooks.get(name, [])]
        return {
            "name": name,
            "webhook_configs": [{"url": url, "send_resolved": True} for url in urls],
        }

    return {
        "route": {
            "receiver": "mesh",
            "group_by": ["alertname", "model", "objective"],
            "group_wait": _seconds(2 * scrape),
            "group_interval": _seconds(5 * scrape),
            "repeat_interval": "4h",
            "routes": [
                {"matchers": [f'severity="{severity}"'], "receiver": severity}
                for severity in SEVERITIES
            ],
        },
        "receivers": [receiver("mesh"), *(receiver(s) for s in SEVERITIES)],
    }


@dataclass
class Alerting:
    """Alertmanager and the mesh's receiver, children of `supervisor`, files under `root`."""

    supervisor: Supervisor
    spec: ResolvedSpec
    root: Path
    binary: str
    port: int = 0
    receiver_port: int = 0

    @property
    def address(self) -> str:
        return f"{self.spec.host}:{self.port}"

    @property
    def receiver_address(self) -> str:
        return f"{self.spec.host}:{self.receiver_port}"

    @property
    def config_file(self) -> Path:
        return self.root / "alertmanager.yml"

    def start(self, timeout_s: float) -> list[Child]:
        """The receiver, then Alertmanager (its config naming the receiver); each waited
        for until it answers."""
        private_dir(self.root)
        host = self.spec.host
        self.receiver_port = self.receiver_port or free_port(host)
        self.port = self.port or free_port(host)
        receiver = self.supervisor.start(
            RECEIVER_NAME,
            [
                sys.executable,
                "-m",
                "servemesh.observe.alert_receiver",
                "--state-dir",
                str(self.spec.state_dir),
                "--listen",
                self.receiver_address,
            ],  # fmt: skip
            group=NAME,
            ready=Check(
                lambda: answers_ok(f"http://{self.receiver_address}/ready"),
                f"alert receiver at {self.receiver_address}",
            ),
            timeout_s=timeout_s,
        )
        config = render_config(self.spec, f"http://{self.receiver_address}")
        atomic_write_text(self.config_file, dump_yaml(config))
        manager = self.supervisor.start(
            NAME,
            [
                self.binary,
                f"--config.file={self.config_file}",
                f"--storage.path={self.root / 'data'}",
                f"--web.listen-address={self.address}",
                # One Alertmanager per mesh: no gossip port opened.
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            group=NAME,
            ready=Check(
                lambda: answers_ok(f"http://{self.address}/-/ready"),
                f"Alertmanager at {self.address} ready",
            ),
            timeout_s=timeout_s,
        )
        return [receiver, manager]
