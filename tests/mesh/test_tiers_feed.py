"""A cache that follows the feature store's change feed (`cache: {freshness: feed}`), on a
real mesh: a hit is answered with no feature read at all, and every kind of change the feed
carries makes the next call go online once the gateways heard of it: a row written by
another writer straight into Redis, a feature load (a new view version), a `servemesh cache
flush`; a row of another entity leaves the cached answer in place."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from servemesh.identity.edge_client import dial_edge_as
from servemesh.launcher import Mesh
from servemesh.observe.scrape import scrape, sum_by
from servemesh.services.feature.store import pack_rows
from servemesh.spec import parse_spec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import test_mesh_spec
from tests.mesh.test_tiers import cli, predict
from tests.waiting import wait_until

GATEWAYS = ("gateway-zone-a-0", "gateway-zone-b-0")
FEED_TIERS = "    tiers:\n      cache: {ttl: 10m, freshness: feed}\n"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = test_mesh_spec(str(tmp_path_factory.mktemp("feed")))
    tiers = parse_spec(f"models:\n  fraud:\n    traffic: {{v1: 100}}\n{FEED_TIERS}")
    fraud = spec.models["fraud"].model_copy(
        update={"tiers": tiers.models["fraud"].tiers, "traffic": {"v1": 100, "v2": 0, "v3": 0}}
    )
    with Mesh.from_spec(spec.model_copy(update={"models": {"fraud": fraud}})) as running:
        wait_until(lambda: all(_metric(running, g, "feed_live") == 1 for g in GATEWAYS),
                   "both gateways following the feed")  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def gateway(mesh: Mesh) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with dial_edge_as(mesh.spec, mesh.spec.edge_address).channel() as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def _metric(mesh: Mesh, gateway: str, name: str) -> float:
    samples = scrape(mesh.spec.metrics_address_of(gateway))
    return sum_by(samples, f"servemesh_gateway_{name}", ()).get((), 0.0)


def _feature_reads(mesh: Mesh) -> float:
    """GetFeatures calls the feature replicas answered so far."""
    total = 0.0
    for replica in ("feature-zone-a-0", "feature-zone-b-0"):
        samples = scrape(mesh.spec.metrics_address_of(replica))
        by_method = sum_by(samples, "servemesh_rpc_requests_total", ("method",))
        total += sum(n for (method,), n in by_method.items() if "GetFeatures" in method)
    return total


def _cached_on_both(
    gateway: gateway_pb2_grpc.GatewayStub, entity: str
) -> gateway_pb2.PredictResponse:
    """Calls until two in a row come from a cache (each gateway fills its own)."""
    streak: list[gateway_pb2.PredictResponse] = []
    for _ in range(12):
        reply = predict(gateway, entity)
        streak = [*streak, reply][-2:] if reply.tier == gateway_pb2.TIER_CACHE else []
        if len(streak) == 2:
            return reply
    raise AssertionError(f"{entity}: not answered from the caches")


def _after_changes(mesh: Mesh, change: object) -> None:
    """Make `change` (a callable), then wait until both gateways heard of a change since."""
    before = {g: _metric(mesh, g, "feed_changes_total") for g in GATEWAYS}
    change()  # type: ignore[operator]
    wait_until(
        lambda: all(_metric(mesh, g, "feed_changes_total") > before[g] for g in GATEWAYS),
        "both gateways to hear of the change",
    )


def _write_row(mesh: Mesh, entity: str, value: float) -> None:
    """Overwrite the entity's row in the view's current version, as another writer would:
    straight into Redis."""
    client = redis.Redis.from_url(mesh.spec.redis_url, password=mesh.spec.redis_password())
    try:
        prefix = mesh.spec.feature_store.key_prefix
        version = int(client.get(f"{prefix}:user:current") or 0)
        (row,) = pack_rows(np.full((1, 64), value, np.float32), np.array([time.time_ns() // 10**6]))
        client.set(f"{prefix}:user@{version}:{entity}", row)
    finally:
        client.close()


def test_a_hit_reads_nothing_and_a_written_row_is_answered_online(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    first = predict(gateway, "user-7")
    cached = _cached_on_both(gateway, "user-7")
    assert list(cached.scores) == list(first.scores) and cached.model_version == "v1"
    # Five hits in a row make no feature call. (A feed distrusted for a moment on a busy
    # host sends a call the read way, answered online: then the five are asked again.)
    for _ in range(5):
        reads = _feature_reads(mesh)
        tiers = [predict(gateway, "user-7").tier for _ in range(5)]
        if tiers == [gateway_pb2.TIER_CACHE] * 5:
            assert _feature_reads(mesh) == reads
            break
    else:
        raise AssertionError(f"never five cached answers in a row; last: {tiers}")

    # Another entity's row changes: user-7's answer stays cached.
    _after_changes(mesh, lambda: _write_row(mesh, "user-8", 0.9))
    assert predict(gateway, "user-7").tier == gateway_pb2.TIER_CACHE

    # user-7's own row changes, by a writer that is not the mesh: online, a new score.
    _after_changes(mesh, lambda: _write_row(mesh, "user-7", 0.9))
    written = predict(gateway, "user-7")
    assert written.tier == gateway_pb2.TIER_ONLINE
    assert list(written.scores) != list(first.scores)


def test_a_flush_and_a_load_each_send_the_next_call_online(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    _cached_on_both(gateway, "user-9")
    _after_changes(mesh, lambda: cli(mesh, "cache", "flush", "fraud"))
    assert predict(gateway, "user-9").tier == gateway_pb2.TIER_ONLINE

    before = _cached_on_both(gateway, "user-9")
    load = mesh.state_dir / "user9.csv"
    features = ",".join(f"f{i:02d}" for i in range(64))
    load.write_text(f"id,{features}\nuser-9,{','.join('0.25' for _ in range(64))}\n")
    _after_changes(
        mesh, lambda: cli(mesh, "features", "load", str(load), "--view", "user", "--key", "id")
    )
    loaded = predict(gateway, "user-9")
    assert loaded.tier == gateway_pb2.TIER_ONLINE
    assert list(loaded.scores) != list(before.scores)
