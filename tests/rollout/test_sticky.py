"""Sticky assignment through a real mesh: the gateway's bucket header, Envoy's bucket-range
routes, the per-version counters the analysis reads (from Prometheus and from the gateways'
own /metrics, which must agree), and a failed call counted against the version it reached.

One mesh for the module (Prometheus included, scraping every half second)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_view import live_view
from servemesh.proxy.render import bucket_ranges
from servemesh.rollout.analysis import (
    ArmSnapshot,
    EndpointsSource,
    PrometheusSource,
    arm_source,
    window,
)
from servemesh.services.gateway.predict import sticky_bucket
from servemesh.services.runtime.faults import FaultSettings, set_fault
from servemesh.spec import MeshSpec, MetricsSpec, ModelSpec, ModelVersionSpec, Ports
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.waiting import wait_until

ENTITIES = 1000
IDS = [f"user-{i}" for i in range(ENTITIES)]


def sticky_spec(state_dir: str) -> MeshSpec:
    return MeshSpec(
        ports=Ports(edge=0, mesh=0, envoy_admin=0, services_base=0),
        state_dir=state_dir,
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="demo:2"),
                },
                traffic={"v1": 75, "v2": 25},
            )
        },
        demo={"enabled": True, "entities": ENTITIES},
        metrics=MetricsSpec(scrape_interval_s=0.5),
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with Mesh.from_spec(sticky_spec(str(tmp_path_factory.mktemp("sticky")))) as running:
        yield running


@pytest.fixture(scope="module")
def routes(mesh: Mesh) -> RouteManager:
    return RouteManager(mesh.paths, AdminClient.of_mesh(mesh.state_dir))


@pytest.fixture(scope="module")
def stub(mesh: Mesh) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with dial_edge(mesh.spec).channel() as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def _versions(stub: gateway_pb2_grpc.GatewayStub, ids: list[str], workers: int = 16) -> list[str]:
    """The version that answered each entity's call (or the failure's status name)."""

    def call(entity: str) -> str:
        try:
            reply = stub.Predict(
                gateway_pb2.PredictRequest(model="fraud", entity_ids=[entity]), timeout=10
            )
        except grpc.RpcError as exc:
            return exc.code().name
        return reply.model_version

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(call, ids))


def _expected(weights: dict[str, int]) -> dict[str, str]:
    """Each entity's version as the gateway's hash and the rendered ranges say."""
    ranges = bucket_ranges(weights)
    found = {}
    for entity in IDS:
        bucket = sticky_bucket("fraud", entity)
        found[entity] = next(v for v, (lo, hi) in ranges.items() if lo <= bucket < hi)
    return found


def test_every_entity_keeps_its_version_at_50_percent_and_the_split_is_even(
    mesh: Mesh, routes: RouteManager, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    at_25 = dict(zip(IDS, _versions(stub, IDS), strict=True))
    assert set(at_25.values()) == {"v1", "v2"}, set(at_25.values())
    assert at_25 == _expected({"v1": 75, "v2": 25})

    routes.set_weights("fraud", {"v1": 50, "v2": 50})
    first = _versions(stub, IDS)
    second = _versions(stub, IDS)
    assert first == second, [
        i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b
    ][:10]
    assert dict(zip(IDS, first, strict=True)) == _expected({"v1": 50, "v2": 50})
    share = first.count("v2") / ENTITIES
    assert abs(share - 0.5) <= 0.05, share
    # The canary grew from 25% to 50%: everyone it had, it kept.
    assert all(first[i] == "v2" for i, e in enumerate(IDS) if at_25[e] == "v2")

    # `routes show` reads the ranges back from what Envoy serves.
    rows = {r.version: r for r in live_view(routes.admin, routes.live_spec())}
    assert rows["v1"].buckets == (0, 5000) and rows["v2"].buckets == (5000, 10000)
    assert rows["v1"].requests > 0 and rows["v2"].requests > 0


def test_a_call_without_an_entity_takes_the_weighted_split(
    routes: RouteManager, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    routes.set_weights("fraud", {"v1": 50, "v2": 50})
    row = gateway_pb2.FeatureRow(values=[0.1] * 64)
    seen = {
        stub.Predict(
            gateway_pb2.PredictRequest(model="fraud", rows=[row]), timeout=10
        ).model_version
        for _ in range(60)
    }
    assert seen == {"v1", "v2"}  # 2**-59 to miss one by chance


def _settled(prom: PrometheusSource, direct: EndpointsSource) -> tuple[ArmSnapshot, ArmSnapshot]:
    """Both sources once Prometheus has scraped what the gateways count now (no traffic
    flows while this waits)."""
    now = direct.snapshot("fraud", shadow=False)

    def caught_up() -> ArmSnapshot | None:
        seen = prom.snapshot("fraud", shadow=False)
        return seen if seen.arms == now.arms else None

    return wait_until(caught_up, "Prometheus to scrape the gateways' counters"), now


def test_prometheus_and_the_gateways_endpoints_give_the_same_window(
    mesh: Mesh, routes: RouteManager, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    prom = arm_source(mesh.spec)
    assert isinstance(prom, PrometheusSource)
    direct = arm_source(mesh.spec, source="endpoints")
    assert isinstance(direct, EndpointsSource)
    routes.set_weights("fraud", {"v1": 50, "v2": 50})
    prom_before, direct_before = _settled(prom, direct)
    answered = _versions(stub, IDS[:400])
    prom_after, direct_after = _settled(prom, direct)
    by_prom = window(prom_before, prom_after)
    by_direct = window(direct_before, direct_after)
    assert by_prom == by_direct
    for version in ("v1", "v2"):
        arm = by_direct[version]
        calls = answered.count(version)
        assert (arm.requests, arm.errors) == (calls, 0), arm
        assert sum(arm.latency_buckets) == calls and sum(arm.score_buckets) == calls, arm


def test_a_failed_call_is_counted_against_the_version_envoy_routed_it_to(
    mesh: Mesh, routes: RouteManager, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    """The replica's error names no version; Envoy's answer header does, so the gateway
    counts each failure against the version of the entity's bucket. (Last in the module:
    failing replicas get ejected for a few seconds.)"""
    routes.set_weights("fraud", {"v1": 50, "v2": 50})
    direct = EndpointsSource(mesh.spec)
    replicas = [i.name for i in mesh.spec.instances() if i.service == "model"]
    before = direct.snapshot("fraud", shadow=False)
    try:
        for name in replicas:
            set_fault(mesh.state_dir, name, FaultSettings(error_percent=100, error_code="INTERNAL"))
        answered = _versions(stub, IDS[:300])
    finally:
        for name in replicas:
            set_fault(mesh.state_dir, name, None)
    assert set(answered) == {"INTERNAL"}
    expected = _expected({"v1": 50, "v2": 50})
    arms = window(before, direct.snapshot("fraud", shadow=False))
    for version in ("v1", "v2"):
        calls = sum(expected[e] == version for e in IDS[:300])
        assert (arms[version].requests, arms[version].errors) == (calls, calls), arms[version]
