"""Precomputed and cached tiers on a real mesh: the cache answers the second call with the
same score and version, a weight change, a feature load and `servemesh cache flush` each
make the next call go online, a real `servemesh batch score --out redis` run is served as
precomputed for the version it scored, and refused when too old or of another version."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from servemesh.identity.edge_client import dial_edge_as
from servemesh.launcher import Mesh
from servemesh.spec import TiersSpec, parse_spec
from servemesh.tier_keys import scores_base
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import apply_live, log_lines, test_mesh_spec
from tests.waiting import wait_until

TIERS = "    tiers:\n      precomputed: {from: redis, max_age: 26h}\n      cache: {ttl: 10m}\n"


def tiered(traffic: str) -> str:
    return f"models:\n  fraud:\n    traffic: {traffic}\n{TIERS}"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = test_mesh_spec(str(tmp_path_factory.mktemp("tiers")))
    fraud = spec.models["fraud"].model_copy(
        update={"tiers": parse_tiers(), "traffic": {"v1": 100, "v2": 0, "v3": 0}}
    )
    with Mesh.from_spec(spec.model_copy(update={"models": {"fraud": fraud}})) as running:
        yield running


def parse_tiers() -> TiersSpec | None:
    return parse_spec(tiered("{v1: 100, v2: 0}")).models["fraud"].tiers


@pytest.fixture(scope="module")
def gateway(mesh: Mesh) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with dial_edge_as(mesh.spec, mesh.spec.edge_address).channel() as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def predict(gateway: gateway_pb2_grpc.GatewayStub, entity: str) -> gateway_pb2.PredictResponse:
    reply: gateway_pb2.PredictResponse = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=[entity]), timeout=10
    )
    return reply


def until_cached(gateway: gateway_pb2_grpc.GatewayStub, entity: str) -> gateway_pb2.PredictResponse:
    """Calls until one is answered from a cache (each gateway fills its own on a miss)."""
    for _ in range(6):
        reply = predict(gateway, entity)
        if reply.tier == gateway_pb2.TIER_CACHE:
            return reply
    raise AssertionError(f"{entity}: never answered from the cache")


def weights(mesh: Mesh, traffic: str) -> None:
    """Apply the weights live; return once both gateways follow them."""

    def taken() -> int:
        lines = log_lines(mesh, "gateway-zone-b-0")
        return sum(1 for line in lines if line.get("msg") == "spec changed")

    before = taken()
    apply_live(mesh, tiered(traffic), "gateway-zone-a-0")
    wait_until(lambda: taken() > before, "gateway-zone-b-0 to take the new spec")


def cli(mesh: Mesh, *args: str) -> str:
    done = subprocess.run(
        # the mesh flags after the command group: every group takes them there
        [sys.executable, "-m", "servemesh", args[0], "--state-dir", str(mesh.state_dir), *args[1:]],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cache_weight_change_flush_and_feature_load(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    first = predict(gateway, "user-5")
    assert (first.tier, first.model_version) == (gateway_pb2.TIER_ONLINE, "v1")
    cached = until_cached(gateway, "user-5")
    assert cached.model_version == "v1" and list(cached.scores) == list(first.scores)

    # flush: the next call is the model's again
    assert "flush generation 1" in cli(mesh, "cache", "flush", "fraud")
    assert predict(gateway, "user-5").tier == gateway_pb2.TIER_ONLINE
    until_cached(gateway, "user-5")

    cli_load = mesh.state_dir / "user5.csv"
    features = ",".join(f"f{i:02d}" for i in range(64))
    values = ",".join("0.5" for _ in range(64))
    cli_load.write_text(f"id,{features}\nuser-5,{values}\n")
    # a load replaces the view: every entity's key changes (a new view version)
    cli(mesh, "features", "load", str(cli_load), "--view", "user", "--key", "id")
    after_load = predict(gateway, "user-5")
    assert after_load.tier == gateway_pb2.TIER_ONLINE
    assert list(after_load.scores) != list(first.scores)

    # weights to v2: the entity's answer is v2's, computed online, never v1's cached one
    weights(mesh, "{v1: 0, v2: 100}")
    moved = predict(gateway, "user-5")
    assert (moved.tier, moved.model_version) == (gateway_pb2.TIER_ONLINE, "v2")
    assert until_cached(gateway, "user-5").model_version == "v2"


def test_precomputed_answers_of_a_batch_run(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    # weights stand at v2 (the test above), whose answer the caches hold
    online = until_cached(gateway, "user-5")
    assert online.model_version == "v2"
    # score v2 into Redis with a real batch run
    cli(mesh, "batch", "score", "--model", "fraud", "--version", "v2", "--out", "redis",
        "--entities", str(_ids(mesh, ["user-5"])))  # fmt: skip
    served = predict(gateway, "user-5")
    assert (served.tier, served.model_version) == (gateway_pb2.TIER_PRECOMPUTED, "v2")
    assert abs(served.scores[0] - online.scores[0]) < 1e-5

    # older than max_age: refused (the cache or the model answers)
    client = redis.Redis.from_url(mesh.spec.redis_url, password=mesh.spec.redis_password())
    base = scores_base(mesh.spec.feature_store.key_prefix, "fraud", "v2")
    run = int(client.get(f"{base}:current") or 0)
    old = int(time.time() * 1000) - 27 * 3600 * 1000
    client.hset(f"{base}@{run}", "scored_at_ms", old)
    assert predict(gateway, "user-5").tier != gateway_pb2.TIER_PRECOMPUTED
    client.hset(f"{base}@{run}", "scored_at_ms", int(time.time() * 1000))
    assert predict(gateway, "user-5").tier == gateway_pb2.TIER_PRECOMPUTED

    # weights back to v1: v2's run is never served for it
    weights(mesh, "{v1: 100, v2: 0}")
    back = predict(gateway, "user-5")
    assert back.model_version == "v1" and back.tier != gateway_pb2.TIER_PRECOMPUTED
    client.close()


def _ids(mesh: Mesh, ids: list[str]) -> Path:
    path = mesh.state_dir / "ids.csv"
    path.write_text("user\n" + "\n".join(ids) + "\n")
    return path
