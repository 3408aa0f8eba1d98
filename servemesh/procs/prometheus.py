"""The mesh's Prometheus: its scrape config and SLI recording rules, rendered from the
spec, and the process, started and stopped by PID like every other child.

Every service instance is a target with labels service, instance and zone (job
`servemesh`), and Envoy's stats listener one more (job `envoy`); storage lives under
`<state_dir>/prometheus`. The recording rules (RULES) compute the SLIs per model, version
and zone from the gateways' metrics, per method from every service's, and per cluster from
Envoy's.
"""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from servemesh.durations import duration_seconds
from servemesh.procs.ready import Check
from servemesh.procs.supervisor import Child, Supervisor
from servemesh.spec import ResolvedSpec
from servemesh.wire import ENVOY_STATS_PATH, SLI_FAILURE_CODES

NAME = "prometheus"
SERVICES_JOB = "servemesh"
ENVOY_JOB = "envoy"
# Over a minute: a 2 s scrape leaves ~30 points per series, enough for a rate and a p99.
WINDOW = "1m"
_FAILED = "|".join(SLI_FAILURE_CODES)
# Health checks and reflection are Envoy's and tools' calls, not the service's work.
_SERVED = 'method!~"/grpc\\\\..*"'


def prometheus_binary() -> str | None:
    """The `prometheus` on PATH (Debian's package: /usr/bin/prometheus), or None."""
    return shutil.which("prometheus")


def promtool_binary() -> str | None:
    return shutil.which("promtool")


def _duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


def _rule(record: str, expr: str) -> dict[str, str]:
    return {"record": record, "expr": " ".join(expr.split())}


def _ratio_ok(metric: str, by: str, where: str = "") -> str:
    sep = "," if where else ""
    return f"""
        sum by ({by}) (rate({metric}{{{where}{sep}code!~"{_FAILED}"}}[{WINDOW}]))
        / sum by ({by}) (rate({metric}{{{where}}}[{WINDOW}]))"""


def _quantile(q: float, histogram: str, by: str, where: str = "") -> str:
    buckets = f"rate({histogram}_bucket{{{where}}}[{WINDOW}])"
    return f"histogram_quantile({q}, sum by ({by}, le) ({buckets}))"


PREDICT = "servemesh_gateway_predictions_total"
PREDICT_SECONDS = "servemesh_gateway_predict_duration_seconds"
RPC = "servemesh_rpc_requests_total"
RPC_SECONDS = "servemesh_rpc_duration_seconds"
BY_VERSION = "model, version, zone"
BY_METHOD = "service, method"

# The recording rules: (record, PromQL). Success means any status but SLI_FAILURE_CODES.
RULES: list[dict[str, str]] = [
    _rule(
        "servemesh:predict_requests:rate1m",
        f"sum by ({BY_VERSION}) (rate({PREDICT}[{WINDOW}]))",
    ),
    _rule("servemesh:predict_success_ratio:rate1m", _ratio_ok(PREDICT, BY_VERSION)),
    _rule(
        "servemesh:predict_degraded_ratio:rate1m",
        f"""sum by ({BY_VERSION}) (rate({PREDICT}{{degraded="true"}}[{WINDOW}]))
            / sum by ({BY_VERSION}) (rate({PREDICT}[{WINDOW}]))""",
    ),
    _rule("servemesh:predict_latency_p50:1m", _quantile(0.5, PREDICT_SECONDS, BY_VERSION)),
    _rule("servemesh:predict_latency_p99:1m", _quantile(0.99, PREDICT_SECONDS, BY_VERSION)),
    _rule(
        "servemesh:rpc_requests:rate1m",
        f"sum by ({BY_METHOD}, zone) (rate({RPC}{{{_SERVED}}}[{WINDOW}]))",
    ),
    _rule("servemesh:rpc_success_ratio:rate1m", _ratio_ok(RPC, f"{BY_METHOD}, zone", _SERVED)),
    _rule(
        "servemesh:rpc_latency_p99:1m",
        _quantile(0.99, RPC_SECONDS, f"{BY_METHOD}, zone", _SERVED),
    ),
    _rule(
        "servemesh:cpu_cores:rate1m",
        f'sum by (service) (rate(process_cpu_seconds_total{{job="{SERVICES_JOB}"}}[{WINDOW}]))',
    ),
    # Envoy's side: requests and p99 (milliseconds, Envoy's unit) per upstream cluster,
    # i.e. per model version and calling zone (cluster model-<m>-<v>-via-<zone>).
    _rule(
        "servemesh:envoy_cluster_requests:rate1m",
        f"sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_total[{WINDOW}]))",
    ),
    _rule(
        "servemesh:envoy_cluster_latency_p99_ms:1m",
        _quantile(0.99, "envoy_cluster_upstream_rq_time", "envoy_cluster_name"),
    ),
]


def render_rules() -> dict[str, Any]:
    return {"groups": [{"name": "servemesh-sli", "rules": RULES}]}


def render_config(spec: ResolvedSpec, rules_file: Path) -> dict[str, Any]:
    """Prometheus's config for the mesh: every instance's /metrics and Envoy's stats."""
    interval = _duration(spec.metrics.scrape_interval_s)
    services = [
        {
            "targets": [spec.metrics_address_of(inst.name)],
            "labels": {"service": inst.service, "instance": inst.name, "zone": inst.zone},
        }
        for inst in spec.instances()
    ]
    return {
        "global": {
            "scrape_interval": interval,
            # A scrape may not outlast the interval (Prometheus refuses the config).
            "scrape_timeout": interval,
            "evaluation_interval": interval,
            "external_labels": {"mesh": spec.name},
        },
        "rule_files": [str(rules_file)],
        "scrape_configs": [
            {
                "job_name": SERVICES_JOB,
                # The RPC metrics carry their own `service` label, equal to the target's:
                # kept as is rather than renamed exported_service.
                "honor_labels": True,
                "static_configs": services,
            },
            {
                "job_name": ENVOY_JOB,
                "metrics_path": ENVOY_STATS_PATH,
                "static_configs": [
                    {
                        "targets": [spec.envoy_stats_address],
                        "labels": {"service": "envoy", "instance": "envoy"},
                    }
                ],
            },
        ],
    }


def _answers_ready(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/-/ready", timeout=0.5) as reply:
            return bool(reply.status == 200)
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class PrometheusServer:
    """The mesh's Prometheus, a child of `supervisor`, its files under `root`."""

    supervisor: Supervisor
    spec: ResolvedSpec
    root: Path
    binary: str

    @property
    def config_file(self) -> Path:
        return self.root / "prometheus.yml"

    @property
    def rules_file(self) -> Path:
        return self.root / "rules.yml"

    def write_config(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.rules_file.write_text(yaml.safe_dump(render_rules(), sort_keys=False))
        config = render_config(self.spec, self.rules_file)
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))

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
        ready = Check(lambda: _answers_ready(address), f"Prometheus at {address} ready")
        return self.supervisor.start(NAME, self.argv(), ready=ready, timeout_s=timeout_s)
