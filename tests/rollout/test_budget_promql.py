"""The error budget's PromQL against a real Prometheus, scraping an exporter the test
controls: calls that all fell between two scrapes (series born with their whole count and
never growing) still spend the budget, in the recording rules and in the gate's reading.

This is the burst a short canary test makes: rate() and increase() alone see a counter only
grow after its first sample, so such a burst would read as no calls at all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from servemesh.observe.prom_query import PromClient
from servemesh.procs.prometheus import PrometheusServer, prometheus_binary
from servemesh.procs.supervisor import Supervisor
from servemesh.rollout.budget import read_from_prometheus
from servemesh.slo_rules import BUDGET_LEFT, SERVICES_JOB, slow_bound_s
from servemesh.spec import MeshSpec, MetricsSpec, Ports, resolve
from servemesh.spec.rollout_plan import RolloutSpec, SloSpec
from tests.waiting import wait_until

PROMETHEUS = prometheus_binary()
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus binary here (Debian package `prometheus`)"
)

SLO = SloSpec(availability=0.99, p99_ms=2000, window="1h")
BOUND = slow_bound_s(SLO.p99_ms)


@dataclass
class Exporter:
    """A /metrics endpoint on loopback whose text the test sets."""

    text: str = ""
    scrapes: int = 0

    def serve(self) -> ThreadingHTTPServer:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server hook's name)
                body = exporter.text.encode()
                exporter.scrapes += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@dataclass
class Scraped:
    exporter: Exporter
    client: PromClient


@pytest.fixture
def scraped(tmp_path: Path) -> Iterator[Scraped]:
    assert PROMETHEUS is not None
    spec = resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(tmp_path),
            metrics=MetricsSpec(scrape_interval_s=1.0),
            rollout=RolloutSpec(slos={"fraud": SLO}),
        )
    )
    exporter = Exporter()
    http = exporter.serve()
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    target = f"127.0.0.1:{http.server_address[1]}"

    class OneTarget(PrometheusServer):
        """The spec's rules and intervals; one scrape target, the exporter."""

        def write_config(self) -> None:
            super().write_config()
            config = yaml.safe_load(self.config_file.read_text())
            config["scrape_configs"] = [
                {"job_name": SERVICES_JOB, "static_configs": [{"targets": [target]}]}
            ]
            self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))

    try:
        with Supervisor(tmp_path / "logs") as supervisor:
            OneTarget(supervisor, spec, tmp_path / "prometheus", PROMETHEUS).start(timeout_s=60)
            yield Scraped(exporter, PromClient(spec.prometheus_address))
    finally:
        http.shutdown()
        http.server_close()
        thread.join()


def _scraped_twice(scraped: Scraped) -> None:
    seen = scraped.exporter.scrapes
    wait_until(lambda: scraped.exporter.scrapes >= seen + 2, "two more scrapes", timeout_s=30)


BURST = f"""
# TYPE servemesh_gateway_predictions counter
servemesh_gateway_predictions_total{{model="fraud",version="v1",code="OK"}} 20
servemesh_gateway_predictions_total{{model="fraud",version="v2",code="OK"}} 70
servemesh_gateway_predictions_total{{model="fraud",version="v2",code="INTERNAL"}} 30
servemesh_gateway_predictions_total{{model="fraud",version="v2",code="NOT_FOUND"}} 5
# TYPE servemesh_gateway_predict_duration_seconds histogram
servemesh_gateway_predict_duration_seconds_bucket{{model="fraud",version="v2",le="{BOUND}"}} 90
servemesh_gateway_predict_duration_seconds_bucket{{model="fraud",version="v2",le="+Inf"}} 100
servemesh_gateway_predict_duration_seconds_count{{model="fraud",version="v2"}} 100
servemesh_gateway_predict_duration_seconds_sum{{model="fraud",version="v2"}} 30.0
"""


def test_a_burst_between_two_scrapes_spends_the_budget_in_the_rules_and_the_gate(
    scraped: Scraped,
) -> None:
    # Prometheus knows the target before the calls: the burst's series are born later.
    _scraped_twice(scraped)
    scraped.exporter.text = BURST

    def recorded(objective: str) -> float | None:
        found = scraped.client.query(f'{BUDGET_LEFT}{{model="fraud",objective="{objective}"}}')
        return found[0][1] if found else None

    # 30 failed of 125 calls (the caller's own NOT_FOUND counts as a call, spends nothing):
    # 24% bad against 1% allowed, the budget spent 24 times over.
    availability = wait_until(lambda: recorded("availability"), "the availability budget rule")
    assert availability == pytest.approx(1 - (30 / 125) / 0.01)
    # 10 of 100 timed calls slower than the objective's bucket, 1% allowed.
    latency = wait_until(lambda: recorded("latency"), "the latency budget rule")
    assert latency == pytest.approx(1 - (10 / 100) / 0.01)

    # Counters that stay flat from here on: the burst still counts, in the gate's reading too.
    _scraped_twice(scraped)
    reading = read_from_prometheus(scraped.client, "fraud", SLO, 1.0, 3600)
    by_name = {o.objective: o for o in reading.objectives}
    assert (by_name["availability"].total, by_name["availability"].bad) == (125, 30)
    assert (by_name["latency"].total, by_name["latency"].bad) == (100, 10)
    assert reading.spent and reading.refuses
    assert reading.detail().startswith("budget spent: budget left -")
