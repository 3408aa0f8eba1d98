"""Sticky assignment and the analysis's readings through a real mesh: the gateway's bucket
header, Envoy's bucket-range routes and `routes show`, the per-version counters the analysis
reads (from Prometheus and from the gateways' own /metrics, which must agree), a failed call
counted against the version it reached, and the shadow step judged from what the replicas
recorded.

One mesh for the module (Prometheus included, scraping every half second)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from servemesh.contract.wire import bucket_ranges
from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.observe.scrape import sample, scrape
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_view import live_view
from servemesh.rollout.analysis import (
    MODEL_CALLS,
    ArmSnapshot,
    EndpointsSource,
    PrometheusSource,
    arm_source,
    judge,
    window,
)
from servemesh.rollout.types import ArmWindow
from servemesh.services.gateway.predict import sticky_bucket
from servemesh.services.runtime.faults import FaultSettings, set_fault
from servemesh.spec import DemoSpec, MeshSpec, MetricsSpec, ModelSpec, ModelVersionSpec, Ports
from servemesh.spec.rollout_plan import AnalysisSpec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.waiting import wait_until

ENTITIES = 1000
IDS = [f"user-{i}" for i in range(ENTITIES)]


def sticky_spec(state_dir: str) -> MeshSpec:
    return MeshSpec(
        ports=Ports.free(),
        state_dir=state_dir,
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="demo:2"),
                    # v1's model made 100 ms slower: only its latency differs.
                    "v3": ModelVersionSpec(source="demo:1", inject_latency_ms=100),
                },
                traffic={"v1": 75, "v2": 25, "v3": 0},
                # A fallback hides a failing version from callers, never from the analysis.
                fallback_score=0.5,
            )
        },
        demo=DemoSpec(enabled=True, entities=ENTITIES),
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


def test_a_failed_call_is_counted_against_the_version_envoy_routed_it_to(
    mesh: Mesh, routes: RouteManager, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    """The replica's error names no version; Envoy's answer header does, so the gateway
    counts each failure against the version of the entity's bucket, though the model's
    fallback answered every caller. First in the module, while the spec is the one the mesh
    started with: a spec change makes the gateways learn the model's signature again, a
    call the faulty replicas would fail before ModelInfer."""
    admin = routes.admin

    def every_gateway_learned_the_signature() -> bool:
        assert set(_versions(stub, IDS[:8])) <= {"v1", "v2"}
        return all(
            sample(scrape(mesh.spec.metrics_address_of(i.name)), MODEL_CALLS) > 0
            for i in mesh.spec.instances()
            if i.service == "gateway"
        )

    wait_until(every_gateway_learned_the_signature, "a model call through every gateway")
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
        # Outlier detection ejected failing hosts; the next tests start with every host back.
        wait_until(
            lambda: all(h.healthy for c in admin.clusters().values() for h in c.hosts),
            "every host of every cluster healthy again",
        )
    assert set(answered) == {"fallback"}
    expected = _expected({"v1": 75, "v2": 25, "v3": 0})
    arms = window(before, direct.snapshot("fraud", shadow=False))
    for version in ("v1", "v2"):
        calls = sum(expected[e] == version for e in IDS[:300])
        assert (arms[version].requests, arms[version].errors) == (calls, calls), {
            v: (a.requests, a.errors) for v, a in arms.items()
        }


def test_every_entity_keeps_its_version_at_50_percent_and_the_split_is_even(
    mesh: Mesh, routes: RouteManager, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    at_25 = dict(zip(IDS, _versions(stub, IDS), strict=True))
    assert set(at_25.values()) == {"v1", "v2"}, set(at_25.values())
    assert at_25 == _expected({"v1": 75, "v2": 25, "v3": 0})

    routes.set_weights("fraud", {"v1": 50, "v2": 50, "v3": 0})
    first = _versions(stub, IDS)
    second = _versions(stub, IDS)
    assert first == second, [
        i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b
    ][:10]
    assert dict(zip(IDS, first, strict=True)) == _expected({"v1": 50, "v2": 50, "v3": 0})
    share = first.count("v2") / ENTITIES
    assert abs(share - 0.5) <= 0.05, share
    # The canary grew from 25% to 50%: everyone it had, it kept.
    assert all(first[i] == "v2" for i, e in enumerate(IDS) if at_25[e] == "v2")

    # `routes show` reads the ranges back from what Envoy serves.
    rows = {r.version: r for r in live_view(routes.admins(), routes.live_spec())}
    assert rows["v1"].buckets == (0, 5000) and rows["v2"].buckets == (5000, 10000)
    assert rows["v1"].requests > 0 and rows["v2"].requests > 0


def test_routes_show_prints_each_version_s_bucket_range(mesh: Mesh, routes: RouteManager) -> None:
    routes.set_weights("fraud", {"v1": 90, "v2": 10, "v3": 0})

    def show(*extra: str) -> str:
        argv = [sys.executable, "-m", "servemesh", "routes", "--state-dir", str(mesh.state_dir)]
        done = subprocess.run(
            [*argv, "show", *extra], capture_output=True, text=True, timeout=60, check=True
        )
        return done.stdout

    rows = {r["version"]: r for r in json.loads(show("--json"))}
    assert rows["v1"]["buckets"] == [0, 9000] and rows["v2"]["buckets"] == [9000, 10000]
    assert rows["v3"]["buckets"] is None
    table = show()
    assert "buckets" in table and "0-8999" in table and "9000-9999" in table


def test_a_call_without_an_entity_takes_the_weighted_split(
    routes: RouteManager, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    routes.set_weights("fraud", {"v1": 50, "v2": 50, "v3": 0})
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
    if mesh.endpoints().get("prometheus") is None:
        pytest.skip("no prometheus binary here (Debian package `prometheus`)")
    prom = arm_source(mesh.spec)
    assert isinstance(prom, PrometheusSource)
    direct = arm_source(mesh.spec, source="endpoints")
    assert isinstance(direct, EndpointsSource)
    routes.set_weights("fraud", {"v1": 50, "v2": 50, "v3": 0})
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


def test_the_shadow_step_reads_the_replicas_records_and_catches_a_slower_version(
    mesh: Mesh, routes: RouteManager, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    """v3 answers nobody at the shadow step; only the replicas see it, and it is 100 ms
    slower than v1 with the same scores: p99 fails, the others pass."""
    routes.set_weights("fraud", {"v1": 100, "v2": 0, "v3": 0})
    routes.set_shadow("fraud", "v3")
    source = arm_source(mesh.spec)
    before = source.snapshot("fraud", shadow=True)
    try:
        answered = _versions(stub, IDS[:300], workers=8)
    finally:
        routes.set_shadow("fraud", None)
    assert set(answered) == {"v1"}  # callers never see the shadow

    def all_copies() -> dict[str, ArmWindow] | None:
        arms = window(before, source.snapshot("fraud", shadow=True))
        done = all(v in arms and arms[v].requests >= 300 for v in ("v1", "v3"))
        return arms if done else None

    arms = wait_until(all_copies, "the replicas to record 300 shadowed calls on both sides")
    verdicts = {
        c.name: c.verdict for c in judge(arms["v1"], arms["v3"], AnalysisSpec(min_samples=100))
    }
    assert verdicts == {"error_ratio": "pass", "p99": "fail", "psi": "pass"}, verdicts
