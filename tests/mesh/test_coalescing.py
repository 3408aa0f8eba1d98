"""Coalescing through a real mesh: concurrent Predicts share the gateway's feature reads and
model calls, and sharing changes no answer, no failure and no deadline.

The slow version (v3: the demo model plus 300 ms a batch) holds a call in flight long enough
for the next Predicts to queue behind it, so they leave together; calls go straight to one
gateway, so they meet in its coalescer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from servemesh.identity import dial_service
from servemesh.launcher import Mesh
from servemesh.observe.scrape import sample, scrape
from servemesh.services.runtime.faults import FaultSettings, set_fault
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import SLOW_VERSION, apply_live
from tests.waiting import wait_until

GATEWAY = "gateway-zone-a-0"
MEMBERS = "servemesh_gateway_coalesced_members"
WAITING = "servemesh_gateway_coalesce_waiting"


@pytest.fixture(scope="module")
def direct(mesh: Mesh) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    """Predict straight to one gateway replica."""
    with dial_service(mesh.spec, GATEWAY).channel() as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def _shared(mesh: Mesh, call: str) -> tuple[float, float]:
    """(calls, Predicts they carried) of the gateway's `call` so far."""
    samples = scrape(mesh.spec.metrics_address_of(GATEWAY))
    return (
        sample(samples, f"{MEMBERS}_count", {"call": call}),
        sample(samples, f"{MEMBERS}_sum", {"call": call}),
    )


def _predict(
    stub: gateway_pb2_grpc.GatewayStub, entity: str, version: str, timeout: float = 10.0
) -> gateway_pb2.PredictResponse | grpc.StatusCode:
    try:
        return stub.Predict(
            gateway_pb2.PredictRequest(model="fraud", version=version, entity_ids=[entity]),
            timeout=timeout,
        )
    except grpc.RpcError as exc:
        return exc.code()


def _when_in_flight(mesh: Mesh, calls_before: float) -> None:
    wait_until(lambda: _shared(mesh, "model")[0] > calls_before, "the first model call left")


def _seen_waiting(mesh: Mesh, count: int, until: Future[Any]) -> bool:
    """Whether `count` Predicts were seen queued for the gateway's next model call before
    `until` (the call they queue behind) returned."""
    while not until.done():
        samples = scrape(mesh.spec.metrics_address_of(GATEWAY))
        if sample(samples, WAITING, {"call": "model"}) >= count:
            return True
        time.sleep(0.01)  # the poll's pace, so it leaves the gateway its core
    return False


def test_concurrent_predicts_share_calls_and_get_the_answers_they_get_alone(
    mesh: Mesh, direct: gateway_pb2_grpc.GatewayStub
) -> None:
    entities = [f"user-{i}" for i in range(24)]
    # Alone, one at a time: v1 and the slow v3 are the same model.
    alone = {e: _predict(direct, e, "v1") for e in entities}
    model_before, features_before = _shared(mesh, "model"), _shared(mesh, "features")
    with ThreadPoolExecutor(max_workers=len(entities)) as pool:
        first = pool.submit(_predict, direct, entities[0], SLOW_VERSION)
        _when_in_flight(mesh, model_before[0])
        rest = list(pool.map(lambda e: _predict(direct, e, SLOW_VERSION), entities[1:]))
    together = dict(zip(entities, [first.result(), *rest], strict=True))
    for entity in entities:
        got, want = together[entity], alone[entity]
        assert isinstance(got, gateway_pb2.PredictResponse), (entity, got)
        assert isinstance(want, gateway_pb2.PredictResponse)
        assert got.model_version == SLOW_VERSION
        assert list(got.scores) == pytest.approx(list(want.scores), abs=1e-6), entity
    calls, members = (a - b for a, b in zip(_shared(mesh, "model"), model_before, strict=True))
    # 24 Predicts in far fewer ModelInfer calls: the 23 queued behind the first left together.
    assert members == len(entities) and calls <= 4, (calls, members)
    feature_calls, _ = (
        a - b for a, b in zip(_shared(mesh, "features"), features_before, strict=True)
    )
    assert feature_calls < len(entities) + len(entities), feature_calls


def test_an_unknown_entity_among_good_ones_fails_alone(
    mesh: Mesh, direct: gateway_pb2_grpc.GatewayStub
) -> None:
    """The view refuses an entity it does not hold (NOT_FOUND): the read they shared is
    asked again one by one, so only that Predict fails. The feature replicas are made slow
    (300 ms a call) so the Predicts queue behind the first read and share the next."""
    replicas = [i.name for i in mesh.spec.instances() if i.service == "feature"]
    good = [f"user-{i}" for i in range(30, 42)]
    before = _shared(mesh, "features")
    try:
        for name in replicas:
            set_fault(mesh.state_dir, name, FaultSettings(delay_percent=100, delay_ms=300))
        with ThreadPoolExecutor(max_workers=len(good) + 1) as pool:
            first = pool.submit(_predict, direct, "user-29", "v1")
            wait_until(
                lambda: _shared(mesh, "features")[0] > before[0], "the first feature read left"
            )
            bad = pool.submit(_predict, direct, "no-such-user", "v1")
            answers = list(pool.map(lambda e: _predict(direct, e, "v1"), good))
    finally:
        for name in replicas:
            set_fault(mesh.state_dir, name, None)
    assert bad.result() == grpc.StatusCode.NOT_FOUND
    assert isinstance(first.result(), gateway_pb2.PredictResponse)
    assert all(isinstance(a, gateway_pb2.PredictResponse) for a in answers), answers
    calls, members = (a - b for a, b in zip(_shared(mesh, "features"), before, strict=True))
    assert members > calls, "no feature read was shared"


def test_a_short_deadline_member_gets_deadline_exceeded_and_the_others_their_answers(
    mesh: Mesh, direct: gateway_pb2_grpc.GatewayStub
) -> None:
    model_before = _shared(mesh, "model")
    with ThreadPoolExecutor(max_workers=8) as pool:
        first = pool.submit(_predict, direct, "user-50", SLOW_VERSION)
        _when_in_flight(mesh, model_before[0])
        # Queued behind a 300 ms call with 80 ms to live: it cannot be answered in time.
        short = pool.submit(_predict, direct, "user-51", SLOW_VERSION, 0.08)
        others = list(pool.map(lambda e: _predict(direct, e, SLOW_VERSION), ["user-52", "user-53"]))
    assert short.result() == grpc.StatusCode.DEADLINE_EXCEEDED
    answered = [first.result(), *others]
    assert all(isinstance(a, gateway_pb2.PredictResponse) for a in answered), answered


def test_apply_turns_coalescing_off_and_back_on_live(
    mesh: Mesh, direct: gateway_pb2_grpc.GatewayStub
) -> None:
    """`servemesh apply` changes the gateways' coalescing in a running mesh: while it is
    off, Predicts queued behind a slow one each make their own calls."""
    lines = apply_live(mesh, "coalescing: {enabled: false}\n", GATEWAY)
    try:
        assert lines == ["~ coalescing: on, max_rows 64 -> off"]
        assert not mesh.paths.running_spec().coalescing.enabled
        before = _shared(mesh, "model"), _shared(mesh, "features")
        entities = [f"user-{i}" for i in range(60, 68)]
        with ThreadPoolExecutor(max_workers=len(entities)) as pool:
            answers = list(pool.map(lambda e: _predict(direct, e, SLOW_VERSION), entities))
        assert all(isinstance(a, gateway_pb2.PredictResponse) for a in answers), answers
        # Not one call went through the coalescer, not even as a lone member.
        assert (_shared(mesh, "model"), _shared(mesh, "features")) == before
    finally:
        lines = apply_live(mesh, "coalescing: {enabled: true, max_rows: 64}\n", GATEWAY)
    assert lines == ["~ coalescing: off -> on, max_rows 64"]
    # Two Predicts seen queued behind the slow one must leave together. On a busy machine
    # they may reach the gateway only after the slow call returned, and then nothing was
    # shown: such a try is made again, not counted either way.
    for attempt in range(5):
        model_before = _shared(mesh, "model")
        entities = [f"user-{70 + 3 * attempt + i}" for i in range(3)]
        with ThreadPoolExecutor(max_workers=3) as pool:
            first = pool.submit(_predict, direct, entities[0], SLOW_VERSION)
            _when_in_flight(mesh, model_before[0])
            rest = [pool.submit(_predict, direct, e, SLOW_VERSION) for e in entities[1:]]
            queued = _seen_waiting(mesh, 2, until=first)
            answers = [first.result(), *(f.result() for f in rest)]
        assert all(isinstance(a, gateway_pb2.PredictResponse) for a in answers), answers
        if queued:
            break
    else:
        pytest.fail("two Predicts never queued behind a 300 ms model call in 5 tries")
    calls, members = (a - b for a, b in zip(_shared(mesh, "model"), model_before, strict=True))
    assert (calls, members) == (2, 3)
