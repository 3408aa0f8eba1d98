"""Deep health across a whole mesh: with the shared Redis stopped every feature replica says
NOT_SERVING, Envoy takes them out, and Predict is refused at once (the test mesh's model has
no fallback) rather than waiting for its deadline; all of it comes back with Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.identity import dial_service
from servemesh.launcher import Mesh
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.envoys import EveryEnvoy
from tests.waiting import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
# Far above a refusal's time; a call that needs it all waited for a deadline.
DEADLINE_S = 10.0


def _statuses(mesh: Mesh, service: str) -> dict[str, str]:
    """Each replica of `service` and what its health service answers now."""
    found: dict[str, str] = {}
    for instance in mesh.spec.instances():
        if instance.service != service:
            continue
        with dial_service(mesh.spec, instance.name).channel() as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
                found[instance.name] = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    reply.status
                )
            except grpc.RpcError as exc:
                found[instance.name] = exc.code().name
    return found


def _all(mesh: Mesh, service: str, status: str) -> dict[str, str] | None:
    seen = _statuses(mesh, service)
    return seen if seen and set(seen.values()) == {status} else None


def _hosts_healthy(admin: EveryEnvoy, mesh: Mesh, service: str = "feature") -> set[bool]:
    """Envoy's verdicts on the replicas of `service`, over every cluster that holds them."""
    addresses = {
        mesh.spec.address_of(i.name) for i in mesh.spec.instances() if i.service == service
    }
    return {
        host.healthy
        for cluster in admin.clusters().values()
        for host in cluster.hosts
        if host.address in addresses
    }


@pytest.fixture
def redis_down(mesh: Mesh) -> Iterator[None]:
    """The mesh's Redis stopped by PID; started again (from its snapshot) after."""
    assert mesh.redis is not None, "the test mesh runs its own Redis"
    wait_until(lambda: _all(mesh, "feature", "SERVING"), "feature replicas SERVING first")
    mesh.redis.outage()
    try:
        yield
    finally:
        mesh.redis.start(timeout_s=30)


def _predict(gateway: gateway_pb2_grpc.GatewayStub) -> tuple[str, float]:
    """One Predict: its outcome ("ok", "degraded" or the status name) and seconds taken."""
    started = time.monotonic()
    try:
        reply = gateway.Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-3"]), timeout=DEADLINE_S
        )
        outcome = "degraded" if reply.degraded else "ok"
    except grpc.RpcError as exc:
        outcome = exc.code().name
    return outcome, time.monotonic() - started


def test_without_redis_features_go_not_serving_and_predict_fails_fast_then_recovers(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub, redis_down: None
) -> None:
    admin = EveryEnvoy(mesh)
    wait_until(lambda: _all(mesh, "feature", "NOT_SERVING"), "every feature replica NOT_SERVING")
    wait_until(
        lambda: _hosts_healthy(admin, mesh) == {False},
        "Envoy to hold every feature replica unhealthy",
    )
    # fraud has no fallback_score and reads features: no gateway can answer.
    wait_until(lambda: _all(mesh, "gateway", "NOT_SERVING"), "every gateway NOT_SERVING")
    outcomes = [_predict(gateway) for _ in range(5)]
    assert {o for o, _ in outcomes} <= {"UNAVAILABLE", "degraded"}, outcomes
    assert max(s for _, s in outcomes) < DEADLINE_S / 2, outcomes

    assert mesh.redis is not None
    mesh.redis.start(timeout_s=30)
    wait_until(lambda: _all(mesh, "feature", "SERVING"), "feature replicas SERVING again")
    wait_until(lambda: _all(mesh, "gateway", "SERVING"), "gateways SERVING again")
    # Every zone's Envoy clusters take the replicas back, not only the one this call used:
    # the tests after this one share the mesh and may go through any zone.
    wait_until(
        lambda: _hosts_healthy(admin, mesh) == {True},
        "Envoy to hold every feature replica healthy again",
    )
    wait_until(
        lambda: _hosts_healthy(admin, mesh, "gateway") == {True},
        "Envoy to hold every gateway healthy again",
    )
    wait_until(lambda: _predict(gateway)[0] == "ok", "Predict answering real scores again")
