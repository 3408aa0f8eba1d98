"""The mesh's Prometheus: its scrape config, rendered from the spec, and the process,
started and stopped by PID like every other child.

Every service instance is a target with labels service, instance and zone (job
`servemesh`), each running stream consumer one (job `servemesh-streams`: the consumer
writes its address under the state dir while it runs), the scaler one (job
`servemesh-scaler`, likewise), and Envoy's stats listener one more (job `envoy`). The
first three are found by file: the instances' file is rewritten whenever the fleet
changes (a replica the scaler or an update starts is scraped from then on, one it stops is
dropped). Storage lives under `<state_dir>/prometheus`. The recording rules it evaluates
(the SLIs, and the error budgets of the spec's SLOs) come from servemesh.slo_rules; they
are written beside the config.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.private import private_dir
from servemesh.contract.wire import ENVOY_STATS_PATH
from servemesh.contract.yaml_text import dump_yaml
from servemesh.procs.ready import Check, answers_ok
from servemesh.procs.supervisor import Child, Supervisor
from servemesh.slo_rules import SERVICES_JOB, render_rules
from servemesh.spec import (
    SCALER_TARGETS_FILE,
    STREAM_TARGETS_GLOB,
    ResolvedSpec,
    proxy_part,
)
from servemesh.spec.durations import duration_seconds

NAME = "prometheus"
ENVOY_JOB = "envoy"
# Stream consumers listen on a free port each, so they are found by file, not listed.
STREAMS_JOB = "servemesh-streams"
SCALER_JOB = "servemesh-scaler"
SERVICES_TARGETS = "services.targets.json"


def prometheus_binary() -> str | None:
    """The `prometheus` on PATH (Debian's package: /usr/bin/prometheus), or None."""
    return shutil.which("prometheus")


def promtool_binary() -> str | None:
    return shutil.which("promtool")


def _duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def service_targets(spec: ResolvedSpec) -> list[dict[str, Any]]:
    """Every service instance as a file-discovery target group."""
    return [
        {
            "targets": [spec.metrics_address_of(inst.name)],
            "labels": {"service": inst.service, "instance": inst.name, "zone": inst.zone},
        }
        for inst in spec.instances()
    ]


def render_config(
    spec: ResolvedSpec,
    rules_file: Path,
    services_file: Path,
    alertmanagers: list[str] | None = None,
) -> dict[str, Any]:
    """Prometheus's config for the mesh: every instance's /metrics (listed in
    `services_file`), the stream consumers', the scaler's and Envoy's stats; its alerts
    sent to `alertmanagers` (host:port each) when there are any."""
    interval = _duration(spec.metrics.scrape_interval_s)

    def by_file(job: str, pattern: Path) -> dict[str, Any]:
        return {
            "job_name": job,
            # The metrics carry their own `service` (and stream) labels, equal to the
            # target's: kept as they are rather than renamed exported_service.
            "honor_labels": True,
            "file_sd_configs": [{"files": [str(pattern)], "refresh_interval": interval}],
        }

    state = Path(spec.state_dir)
    return {
        "global": {
            "scrape_interval": interval,
            # A scrape may not outlast the interval (Prometheus refuses the config).
            "scrape_timeout": interval,
            "evaluation_interval": interval,
            "external_labels": {"mesh": spec.name},
        },
        "rule_files": [str(rules_file)],
        **(
            {"alerting": {"alertmanagers": [{"static_configs": [{"targets": alertmanagers}]}]}}
            if alertmanagers
            else {}
        ),
        "scrape_configs": [
            by_file(SERVICES_JOB, services_file),
            by_file(STREAMS_JOB, state / STREAM_TARGETS_GLOB),
            by_file(SCALER_JOB, state / SCALER_TARGETS_FILE),
            {
                "job_name": ENVOY_JOB,
                "metrics_path": ENVOY_STATS_PATH,
                # Every Envoy of the mesh: the edge's (the shared layout's only one) is
                # instance "envoy", a zone's "envoy-<zone>".
                "static_configs": [
                    {
                        "targets": [spec.proxy_stats_address(proxy)],
                        "labels": {
                            "service": "envoy",
                            "instance": proxy_part(proxy),
                        },
                    }
                    for proxy in spec.proxies()
                ],
            },
        ],
    }


@dataclass
class PrometheusServer:
    """The mesh's Prometheus, a child of `supervisor`, its files under `root`."""

    supervisor: Supervisor
    spec: ResolvedSpec
    root: Path
    binary: str
    # Where its alerts go (servemesh.procs.alertmanager), host:port; None: nowhere.
    alertmanager: str | None = None

    @property
    def config_file(self) -> Path:
        return self.root / "prometheus.yml"

    @property
    def rules_file(self) -> Path:
        return self.root / "rules.yml"

    @property
    def services_file(self) -> Path:
        return self.root / SERVICES_TARGETS

    def write_config(self) -> None:
        private_dir(self.root)  # its data too: Prometheus runs under umask 077
        atomic_write_text(self.rules_file, dump_yaml(render_rules(self.spec)))
        self.write_targets(self.spec)
        alertmanagers = [self.alertmanager] if self.alertmanager else None
        config = render_config(self.spec, self.rules_file, self.services_file, alertmanagers)
        atomic_write_text(self.config_file, dump_yaml(config))

    def write_targets(self, spec: ResolvedSpec) -> None:
        """The instances of `spec` as the services job's targets (whole, by rename:
        Prometheus never reads half a file); it reads them again within an interval."""
        self.spec = spec
        atomic_write_text(self.services_file, json.dumps(service_targets(spec), indent=1) + "\n")

    def argv(self) -> list[str]:
        retention = f"{round(duration_seconds(self.spec.metrics.retention))}s"
        return [
            self.binary,
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.root / 'data'}",
            f"--storage.tsdb.retention.time={retention}",
            f"--web.listen-address={self.spec.prometheus_address}",
            "--log.level=warn",
        ]

    def start(self, timeout_s: float) -> Child:
        """Write the config, start Prometheus and wait until /-/ready answers."""
        self.write_config()
        address = self.spec.prometheus_address
        ready = Check(
            lambda: answers_ok(f"http://{address}/-/ready"), f"Prometheus at {address} ready"
        )
        return self.supervisor.start(NAME, self.argv(), ready=ready, timeout_s=timeout_s)
