"""Every service's /metrics after calls through the edge, the mesh's Prometheus scraping
them all, its recording rules, and `servemesh top` with and without Prometheus."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import grpc
import pytest

from servemesh.contract.wire import GATEWAY_SERVICE, OIP_SERVICE, method_path
from servemesh.launcher import Mesh
from servemesh.observe.prom_query import PromClient
from servemesh.observe.scrape import Sample, sample, scrape
from servemesh.spec import proxy_part
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.waiting import wait_until

PREDICT = method_path(GATEWAY_SERVICE, "Predict")
GOOD = gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"])
MISSING = gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-does-not-exist"])
BAD_ROW = gateway_pb2.PredictRequest(
    model="fraud", rows=[gateway_pb2.FeatureRow(values=[0.1] * 63)]
)


def _mesh_samples(mesh: Mesh, service: str) -> list[Sample]:
    """Every sample of every instance of `service`."""
    found: list[Sample] = []
    for inst in mesh.spec.instances():
        if inst.service == service:
            found += scrape(mesh.spec.metrics_address_of(inst.name))
    return found


def _rpc(samples: list[Sample], method: str, code: str) -> float:
    return sample(samples, "servemesh_rpc_requests_total", {"method": method, "code": code})


def _send(edge: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.PredictRequest) -> None:
    try:
        edge.Predict(request, timeout=5)
    except grpc.RpcError:
        pass  # the status is what the metrics are checked for


def test_each_service_counts_its_calls_by_method_and_status(
    metrics_mesh: Mesh, edge: gateway_pb2_grpc.GatewayStub
) -> None:
    services = ("gateway", "feature", "model")
    before = {s: _mesh_samples(metrics_mesh, s) for s in services}
    for _ in range(3):
        _send(edge, GOOD)
    _send(edge, BAD_ROW)
    seconds = "servemesh_rpc_duration_seconds_count"
    labels = {"method": PREDICT}

    # A call is counted as its handler ends, which can come just after the caller has its
    # answer (an abort sends the status before the handler's frame unwinds): the numbers
    # are read once the last call, the refused one, is counted in both its series.
    def last_call_counted() -> dict[str, list[Sample]] | None:
        now = {s: _mesh_samples(metrics_mesh, s) for s in services}
        refused = _rpc(now["gateway"], PREDICT, "INVALID_ARGUMENT") - _rpc(
            before["gateway"], PREDICT, "INVALID_ARGUMENT"
        )
        timed = sample(now["gateway"], seconds, labels) - sample(before["gateway"], seconds, labels)
        return now if refused >= 1 and timed >= 4 else None

    after = wait_until(last_call_counted, "the refused Predict counted as INVALID_ARGUMENT")

    def moved(service: str, method: str, code: str) -> float:
        return _rpc(after[service], method, code) - _rpc(before[service], method, code)

    assert moved("gateway", PREDICT, "OK") == 3
    # The bad row is refused by the gateway, and the metric says so.
    assert moved("gateway", PREDICT, "INVALID_ARGUMENT") == 1
    assert moved("feature", "/servemesh.feature.v1.FeatureService/GetFeatures", "OK") == 3
    assert moved("model", method_path(OIP_SERVICE, "ModelInfer"), "OK") == 3
    # The latency histogram counts the same calls, and the process collector is there.
    assert (
        sample(after["gateway"], seconds, labels) - sample(before["gateway"], seconds, labels) == 4
    )
    assert sample(after["gateway"], "process_cpu_seconds_total") > 0
    assert sample(after["gateway"], "servemesh_rpc_in_flight", labels) == 0
    # The gateway's own per-model counters: the answering version, not degraded.
    ok = {"model": "fraud", "version": "v1", "degraded": "false", "code": "OK"}
    predictions = "servemesh_gateway_predictions_total"
    assert (
        sample(after["gateway"], predictions, ok) - sample(before["gateway"], predictions, ok) == 3
    )
    # The model server's batcher metrics share its endpoint.
    assert sample(after["model"], "servemesh_model_requests_total", {"outcome": "ok"}) >= 3


def test_the_registry_counts_its_operations(metrics_mesh: Mesh) -> None:
    samples = scrape(metrics_mesh.spec.metrics_address_of("registry-0"))
    # The demo seeding uploaded both versions, and the model servers downloaded them.
    assert sample(samples, "servemesh_registry_uploads_total", {"outcome": "accepted"}) >= 1
    assert sample(samples, "servemesh_registry_upload_bytes_total") > 0
    assert sample(samples, "servemesh_registry_downloads_total") >= 2
    uploads = {"method": "/servemesh.registry.v1.Registry/UploadVersion", "code": "OK"}
    assert sample(samples, "servemesh_rpc_requests_total", uploads) >= 1


def test_the_feature_service_counts_reads_and_misses_per_view(
    metrics_mesh: Mesh, edge: gateway_pb2_grpc.GatewayStub
) -> None:
    view = {"view": "user"}
    before = _mesh_samples(metrics_mesh, "feature")
    _send(edge, GOOD)
    _send(edge, MISSING)
    not_found = {"code": "NOT_FOUND", "method": "/servemesh.feature.v1.FeatureService/GetFeatures"}

    # A call is counted as its handler ends, which can come just after the caller has its
    # status: the numbers are read once the last call's count is in.
    def last_call_counted() -> list[Sample] | None:
        now = _mesh_samples(metrics_mesh, "feature")
        counted = sample(now, "servemesh_rpc_requests_total", not_found)
        return now if counted > sample(before, "servemesh_rpc_requests_total", not_found) else None

    after = wait_until(last_call_counted, "the missing entity's read counted as NOT_FOUND")

    def moved(name: str, labels: dict[str, str] = view) -> float:
        return sample(after, name, labels) - sample(before, name, labels)

    assert moved("servemesh_rpc_requests_total", not_found) == 1
    assert moved("servemesh_feature_reads_total") == 2
    assert moved("servemesh_feature_entities_read_total") == 2
    assert moved("servemesh_feature_misses_total") == 1
    assert moved("servemesh_feature_redis_read_seconds_count") == 2


def _prometheus(mesh: Mesh) -> PromClient:
    endpoints = mesh.endpoints()
    address = endpoints["prometheus"]
    if address is None:
        pytest.skip("no prometheus binary here (Debian package `prometheus`): nothing to scrape")
    return PromClient(str(address))


def test_prometheus_scrapes_every_service_and_envoy(metrics_mesh: Mesh) -> None:
    client = _prometheus(metrics_mesh)
    spec = metrics_mesh.spec
    # Every service, and every Envoy (the edge's, and each zone's: envoy-<zone>).
    expected = {i.name for i in spec.instances()} | {proxy_part(p) for p in spec.proxies()}

    def all_up() -> set[str] | None:
        up = {t["labels"]["instance"] for t in client.targets() if t["health"] == "up"}
        return up if up == expected else None

    up = wait_until(all_up, "every target up in Prometheus", timeout_s=60, every_s=0.5)
    assert up == expected
    labels = {t["labels"]["instance"]: t["labels"] for t in client.targets()}
    assert labels["feature-zone-b-0"]["service"] == "feature"
    assert labels["feature-zone-b-0"]["zone"] == "zone-b"


def test_the_recording_rules_yield_the_slis_after_traffic(
    metrics_mesh: Mesh, edge: gateway_pb2_grpc.GatewayStub
) -> None:
    client = _prometheus(metrics_mesh)

    def recorded() -> list[tuple[dict[str, str], float]] | None:
        for _ in range(5):
            _send(edge, GOOD)  # traffic while the rules' window fills
        found = client.query('servemesh:predict_success_ratio:rate1m{model="fraud",version="v1"}')
        return found or None

    ratios = wait_until(
        recorded, "a success ratio recorded for fraud v1", timeout_s=60, every_s=0.5
    )
    assert {labels["zone"] for labels, _ in ratios} <= {"zone-a", "zone-b"}
    assert all(value == 1.0 for _, value in ratios)
    p99 = wait_until(
        lambda: client.query('servemesh:predict_latency_p99:1m{version="v1"}'),
        "a p99 recorded for fraud v1",
        timeout_s=30,
        every_s=0.5,
    )
    assert all(0 < value < 10 for _, value in p99)


def _top(mesh: Mesh, source: str) -> dict[str, Any]:
    answer = subprocess.run(
        [
            sys.executable,
            "-m",
            "servemesh",
            "top",
            "--json",
            "--source",
            source,
            "--state-dir",
            str(mesh.state_dir),
            "--interval",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answer.returncode == 0, answer.stderr
    report: dict[str, Any] = json.loads(answer.stdout)
    return report


@pytest.mark.parametrize("source", ["direct", "prometheus"])
def test_top_shows_the_version_traffic_went_to(
    metrics_mesh: Mesh, edge: gateway_pb2_grpc.GatewayStub, source: str
) -> None:
    if source == "prometheus":
        _prometheus(metrics_mesh)
    import threading

    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            _send(edge, GOOD)

    sender = threading.Thread(target=load)
    sender.start()
    try:

        def seen() -> dict[str, Any] | None:
            report = _top(metrics_mesh, source)
            versions = report["versions"]
            assert isinstance(versions, list)
            v1 = [r for r in versions if r["model"] == "fraud" and r["version"] == "v1"]
            return report if v1 and v1[0]["rps"] > 0 else None

        report = wait_until(seen, f"top ({source}) to show fraud v1 traffic", timeout_s=90)
    finally:
        stop.set()
        sender.join()
    assert report["source"] == ("prometheus" if source == "prometheus" else "metrics endpoints")
    services = {r["service"]: r for r in report["services"]}
    assert services["gateway"]["rps"] > 0
    cost = report["cost"]
    assert isinstance(cost, dict)
    assert cost["predictions"] > 0
    assert cost["cpu_seconds_per_million"] > 0
    assert {"gateway", "feature", "model", "envoy", "redis"} <= set(cost["cpu_seconds_by_part"])
