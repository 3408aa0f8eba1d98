"""A model replica killed mid-stream: Envoy retries on the other zone's replica, nobody fails."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc

from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc


def test_sigkilled_model_replica_is_masked_by_retries(mesh: Mesh) -> None:
    victim = "model-fraud-zone-a-0"
    total, kill_after = 200, 60
    outcomes: list[str] = []
    with dial_edge(mesh.spec).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def call(i: int) -> str:
            if i == kill_after:
                mesh.kill(victim, signal.SIGKILL)
            try:
                stub.Predict(
                    gateway_pb2.PredictRequest(model="fraud", entity_ids=[f"user-{i}"]), timeout=5
                )
                return "ok"
            except grpc.RpcError as exc:
                return f"{exc.code().name}: {exc.details()}"

        try:
            # Four callers in flight, so requests are on the victim's connection when it dies.
            with ThreadPoolExecutor(max_workers=4) as pool:
                outcomes = list(pool.map(call, range(total)))
        finally:
            if not mesh.children[victim].alive():
                mesh.restart(victim)
    failures = [o for o in outcomes if o != "ok"]
    assert len(outcomes) == total
    assert not failures, failures[:5]
    assert mesh.children[victim].popen.returncode is None  # restarted for the tests after us
