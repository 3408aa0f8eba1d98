"""Precomputed and cached tiers on a real mesh: the cache answers the second call with the
same score and version, a weight change, a feature load and `servemesh cache flush` each
make the next call go online, a real `servemesh batch score --out redis` run is served as
precomputed for the version it scored, and refused when too old or of another version; with
the mesh's Redis down the tiers are skipped (counted) and the call ends as the online path
ends, and they answer again once Redis is back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from servemesh.contract.tier_keys import scores_base
from servemesh.identity import dial_service
from servemesh.identity.edge_client import dial_edge_as
from servemesh.launcher import Mesh
from servemesh.observe.scrape import scrape, sum_by
from servemesh.spec import TiersSpec, parse_spec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import apply_live, log_lines, test_mesh_spec
from tests.waiting import wait_until

TIERS = "    tiers:\n      precomputed: {from: redis, max_age: 26h}\n      cache: {ttl: 10m}\n"
GATEWAY = "gateway-zone-a-0"
LOOKUPS = "servemesh_gateway_tier_lookups_total"
# A gateway's feature read once its Envoy holds no feature replica healthy.
SETTLED = "feature service: no healthy upstream"


def tiered(traffic: str, extra: str = "", tiers: str = TIERS) -> str:
    return f"models:\n  fraud:\n    traffic: {traffic}\n{extra}{tiers}"


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


def weights(mesh: Mesh, traffic: str, extra: str = "", tiers: str = TIERS) -> None:
    """Apply the weights (and `extra` fields, `tiers`) live; return once both gateways
    follow them."""

    def taken() -> int:
        lines = log_lines(mesh, "gateway-zone-b-0")
        return sum(1 for line in lines if line.get("msg") == "spec changed")

    before = taken()
    apply_live(mesh, tiered(traffic, extra, tiers), "gateway-zone-a-0")
    wait_until(lambda: taken() > before, "gateway-zone-b-0 to take the new spec")


def cli(mesh: Mesh, *args: str) -> str:
    done = subprocess.run(
        # the mesh flags after the command group: every group takes them there
        [sys.executable, "-m", "servemesh", args[0], "--state-dir", str(mesh.state_dir), *args[1:]],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_predict_json_names_the_tier_that_answered(mesh: Mesh) -> None:
    # First in the module: user-11 is still in the view and in no tier yet. Each gateway
    # fills its own cache, so a later call is answered from one within a few calls.
    seen = []
    for _ in range(6):
        answer = json.loads(
            cli(mesh, "predict", "--model", "fraud", "--entity", "user-11", "--json")
        )
        seen.append(answer["tier"])
        if answer["tier"] == "cache":
            break
    assert seen[0] == "online" and seen[-1] == "cache", seen
    # The text answer says so too (an online answer says nothing of tiers).
    texts = []
    for _ in range(6):
        texts.append(cli(mesh, "predict", "--model", "fraud", "--entity", "user-11"))
        if "answered by: the cache tier" in texts[-1]:
            break
    assert "answered by: the cache tier" in texts[-1], texts


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


def _skipped(mesh: Mesh) -> float:
    """The gateway's tier lookups of fraud skipped so far, every tier."""
    samples = scrape(mesh.spec.metrics_address_of(GATEWAY))
    return sum_by(samples, LOOKUPS, ("model", "result")).get(("fraud", "skipped"), 0.0)


def _outcome(stub: gateway_pb2_grpc.GatewayStub, entity: str) -> tuple[object, ...]:
    """A Predict's answer as the caller sees it, less its request id: the status code on
    an error, else (scores, version, tier, degraded, reason)."""
    try:
        reply = predict(stub, entity)
    except grpc.RpcError as exc:
        return (exc.code(),)
    return (
        tuple(round(s, 6) for s in reply.scores),
        reply.model_version,
        reply.tier,
        reply.degraded,
        reply.degraded_reason,
    )


def _fallen_back(stub: gateway_pb2_grpc.GatewayStub) -> tuple[object, ...]:
    """A Predict of user-5 that must end on fraud's fallback, as the online path does
    without features; its outcome."""
    outcome = _outcome(stub, "user-5")
    assert outcome[:4] == ((0.25,), "fallback", gateway_pb2.TIER_ONLINE, True), outcome
    assert str(outcome[4]).startswith("feature service: "), outcome
    return outcome


def test_redis_down_skips_the_tiers_and_ends_as_online(mesh: Mesh) -> None:
    # A fallback keeps the gateways serving without features: the calls reach a gateway,
    # which must try the tiers, skip them, and end as it would online (the fallback answer).
    fallback = "    fallback_score: 0.25\n"
    weights(mesh, "{v1: 100, v2: 0}", fallback)
    # (the feature load above left user-5 alone in the view)
    assert mesh.redis is not None, "the test mesh runs its own Redis"
    with dial_service(mesh.spec, GATEWAY).channel() as channel:
        direct = gateway_pb2_grpc.GatewayStub(channel)
        assert until_cached(direct, "user-5").model_version == "v1"

        skipped = _skipped(mesh)
        mesh.redis.outage()
        try:
            # Every call ends on the fallback, the tiers tried and skipped (counted). The
            # reason's wording follows each hop noticing (the feature replicas' health,
            # Envoy's checks of them); settled once Envoy holds none of them healthy.
            calls = [_fallen_back(direct)]

            def settled() -> bool:
                calls.append(_fallen_back(direct))
                return calls[-1][4] == SETTLED

            wait_until(settled, "Envoy to hold no feature replica healthy", timeout_s=60)
            assert _skipped(mesh) >= skipped + len(calls)

            # The online path with Redis down: the same model without tiers, the same
            # call, ends alike (each apply swaps Envoy's config: settled again after).
            weights(mesh, "{v1: 100, v2: 0}", fallback, tiers="    tiers: null\n")
            before = _skipped(mesh)
            wait_until(lambda: _fallen_back(direct) == calls[-1], "online: as tiered", timeout_s=60)
            assert _skipped(mesh) == before  # no tiers, no lookup
            weights(mesh, "{v1: 100, v2: 0}", fallback)
            wait_until(lambda: _fallen_back(direct) == calls[-1], "tiered: as online", timeout_s=60)
            assert _skipped(mesh) > before
        finally:
            mesh.redis.start(timeout_s=30)

        # Redis back: the tiers answer again (the cache fills on a miss, then hits).
        wait_until(
            lambda: predict(direct, "user-5").tier == gateway_pb2.TIER_CACHE,
            "the cache to answer again",
        )
        assert predict(direct, "user-5").model_version == "v1"
