"""The Prometheus config and rules a spec renders pass promtool; the scrape arithmetic
`servemesh top` uses without Prometheus agrees with PromQL's definitions."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import start_http_server

from servemesh.observe.prom_query import PromClient
from servemesh.observe.scrape import delta, parse, quantile, quantiles_by, sum_by
from servemesh.procs.prometheus import (
    STREAMS_JOB,
    PrometheusServer,
    prometheus_binary,
    promtool_binary,
    render_config,
    service_targets,
)
from servemesh.procs.supervisor import Supervisor
from servemesh.slo_rules import SERVICES_JOB, render_rules
from servemesh.spec import MeshSpec, MetricsSpec, Ports, resolve
from servemesh.streams.metrics import StreamMetrics
from servemesh.streams.process import targets_path, write_targets
from tests.waiting import wait_until

PROMTOOL = promtool_binary()
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package `prometheus`)"
)
PROMETHEUS = prometheus_binary()


def _spec(tmp_path: Path) -> MeshSpec:
    return resolve(MeshSpec(ports=Ports.free(), state_dir=str(tmp_path)))


@needs_promtool
def test_the_rendered_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    spec = resolve(_spec(tmp_path))
    with Supervisor(tmp_path / "logs") as supervisor:
        server = PrometheusServer(supervisor, spec, tmp_path / "prometheus", "prometheus")
        server.write_config()
    assert PROMTOOL is not None
    rules = subprocess.run(
        [PROMTOOL, "check", "rules", str(server.rules_file)], capture_output=True, text=True
    )
    assert rules.returncode == 0, rules.stdout + rules.stderr
    count = sum(len(group["rules"]) for group in render_rules(spec)["groups"])
    assert f"SUCCESS: {count} rules found" in rules.stdout
    config = subprocess.run(
        [PROMTOOL, "check", "config", str(server.config_file)], capture_output=True, text=True
    )
    assert config.returncode == 0, config.stdout + config.stderr


def test_every_instance_and_envoy_are_targets_labelled_service_instance_zone(
    tmp_path: Path,
) -> None:
    spec = resolve(_spec(tmp_path))
    config = render_config(spec, tmp_path / "rules.yml", tmp_path / "services.json")
    services, streams, scaler, envoy = config["scrape_configs"]
    assert services["file_sd_configs"][0]["files"] == [f"{tmp_path}/services.json"]
    assert streams["file_sd_configs"][0]["files"] == [f"{tmp_path}/streams/*.targets.json"]
    assert scaler["file_sd_configs"][0]["files"] == [f"{tmp_path}/scaling/scaler.targets.json"]
    targets = {t["labels"]["instance"]: t for t in service_targets(spec)}
    assert set(targets) == {i.name for i in spec.instances()}
    gateway = targets["gateway-zone-b-0"]
    assert gateway["labels"] == {
        "service": "gateway",
        "instance": "gateway-zone-b-0",
        "zone": "zone-b",
    }
    assert gateway["targets"] == [spec.metrics_address_of("gateway-zone-b-0")]
    assert envoy["metrics_path"] == "/stats/prometheus"
    assert envoy["static_configs"][0]["targets"] == [spec.envoy_stats_address]
    assert config["global"]["scrape_interval"] == "2000ms"
    records = {r["record"] for r in render_rules()["groups"][0]["rules"]}
    assert {"servemesh:predict_success_ratio:rate1m", "servemesh:predict_latency_p99:1m"} <= records
    yaml.safe_dump(config)  # plain data, as written


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian package)")
def test_targets_found_by_file_come_and_go_a_stream_consumer_and_a_fleet_replica(
    tmp_path: Path,
) -> None:
    """A stream consumer's /metrics is scraped while its file is there; a model server the
    fleet adds (as the scaler's change does) becomes a target, and leaves once dropped.
    Both change at once: Prometheus sends discovered targets on at most every 5 s."""
    base = _spec(tmp_path)
    # Prometheus reads the files again every scrape interval: a short one.
    spec = resolve(base.model_copy(update={"metrics": MetricsSpec(scrape_interval_s=0.5)}))
    metrics = StreamMetrics("orders")
    metrics.events.labels("orders", "predicted").inc(7)
    server, thread = start_http_server(0, "127.0.0.1", registry=metrics.registry)
    assert PROMETHEUS is not None

    def instances(prometheus: PromClient, job: str) -> set[str]:
        found = prometheus.targets()
        return {t["labels"]["instance"] for t in found if t["labels"].get("job") == job}

    try:
        first = {i.name for i in spec.instances()}
        fleet = spec.fleet.model_copy(update={"model_pools": {"fraud": {"zone-a": 2, "zone-b": 1}}})
        grown = resolve(spec.model_copy(update={"fleet": fleet}))
        added = {i.name for i in grown.instances()} - first
        assert added == {"model-fraud-zone-a-1"}
        with Supervisor(tmp_path / "logs") as supervisor:
            prom = PrometheusServer(supervisor, spec, tmp_path / "prometheus", PROMETHEUS)
            prom.start(30)
            prometheus = PromClient(spec.prometheus_address)
            wait_until(lambda: instances(prometheus, SERVICES_JOB) == first, "the instances")
            targets = targets_path(spec.state_dir, "orders", "consumer-1")
            write_targets(targets, f"127.0.0.1:{server.server_port}", "orders", "consumer-1")
            prom.write_targets(grown)

            def events() -> list[tuple[dict[str, str], float]]:
                return prometheus.query('servemesh_stream_events_total{outcome="predicted"}')

            [(labels, value)] = wait_until(events, "Prometheus to scrape the consumer")
            assert value == 7.0
            assert (labels["job"], labels["stream"], labels["instance"]) == (
                STREAMS_JOB,
                "orders",
                "consumer-1",
            )
            wait_until(
                lambda: instances(prometheus, SERVICES_JOB) == first | added, "the new replica"
            )
            targets.unlink()  # as the consumer does on its way out
            prom.write_targets(spec)  # the fleet drops the replica again

            def dropped() -> bool:
                return not instances(prometheus, STREAMS_JOB) and (
                    instances(prometheus, SERVICES_JOB) == first
                )

            wait_until(dropped, "Prometheus to drop the consumer and the replica")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


TEXT_BEFORE = """
# TYPE servemesh_rpc_requests counter
servemesh_rpc_requests_total{service="gateway",method="/a/Predict",code="OK"} 10
servemesh_rpc_requests_total{service="gateway",method="/a/Predict",code="UNAVAILABLE"} 1
# TYPE servemesh_rpc_duration_seconds histogram
servemesh_rpc_duration_seconds_bucket{service="gateway",method="/a/Predict",le="0.001"} 5
servemesh_rpc_duration_seconds_bucket{service="gateway",method="/a/Predict",le="0.01"} 11
servemesh_rpc_duration_seconds_bucket{service="gateway",method="/a/Predict",le="+Inf"} 11
servemesh_rpc_duration_seconds_count{service="gateway",method="/a/Predict"} 11
servemesh_rpc_duration_seconds_sum{service="gateway",method="/a/Predict"} 0.03
"""
TEXT_AFTER = """
# TYPE servemesh_rpc_requests counter
servemesh_rpc_requests_total{service="gateway",method="/a/Predict",code="OK"} 100
servemesh_rpc_requests_total{service="gateway",method="/a/Predict",code="UNAVAILABLE"} 11
servemesh_rpc_requests_total{service="gateway",method="/a/Predict",code="INVALID_ARGUMENT"} 3
# TYPE servemesh_rpc_duration_seconds histogram
servemesh_rpc_duration_seconds_bucket{service="gateway",method="/a/Predict",le="0.001"} 5
servemesh_rpc_duration_seconds_bucket{service="gateway",method="/a/Predict",le="0.01"} 111
servemesh_rpc_duration_seconds_bucket{service="gateway",method="/a/Predict",le="+Inf"} 114
servemesh_rpc_duration_seconds_count{service="gateway",method="/a/Predict"} 114
servemesh_rpc_duration_seconds_sum{service="gateway",method="/a/Predict"} 0.6
"""


def test_counters_are_diffed_and_quantiles_interpolated_as_promql_does() -> None:
    target = {"zone": "zone-a"}  # a target's labels, added to every sample of its scrapes
    moved = delta(parse(TEXT_BEFORE, target), parse(TEXT_AFTER, target))
    by_code = sum_by(moved, "servemesh_rpc_requests_total", ("code",))
    # A series new since the first scrape counts whole.
    assert by_code == {("OK",): 90, ("UNAVAILABLE",): 10, ("INVALID_ARGUMENT",): 3}
    [(p50, p99)] = quantiles_by(
        moved, "servemesh_rpc_duration_seconds", ("service",), (0.5, 0.99)
    ).values()
    # 103 new observations: none at or below 1 ms, 100 in (1 ms, 10 ms], 3 above.
    assert p50 == pytest.approx(0.001 + 0.009 * (51.5 / 100))
    assert p99 == pytest.approx(0.01)  # above the last finite bound: that bound
    assert math.isnan(quantile(0.5, {}))
