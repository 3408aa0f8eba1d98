"""The prediction log on a real mesh: every Predict through the edge leaves one record
with the right fields, `servemesh log query` answers the SRE's questions, and a full
buffer never fails a request."""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import grpc
import pytest

from servemesh.cli import main
from servemesh.contract.demo import demo_features
from servemesh.contract.wire import GATEWAY_SERVICE
from servemesh.identity import dial_mesh
from servemesh.launcher import Mesh
from servemesh.predlog.buffer import PredictionLog, predictions_dir
from servemesh.predlog.query import LogQuery, ParquetReader
from servemesh.services.gateway.service import GatewayServicer
from servemesh.services.runtime import ServiceServer
from servemesh.spec import PredictionLogSpec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.predlog.records import CONTEXT, BlockedStore
from tests.waiting import wait_until


def _traced_call(
    gateway: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.PredictRequest
) -> tuple[str, grpc.StatusCode, gateway_pb2.PredictResponse | None]:
    """Call Predict with a traceparent of its own; its trace id finds the record."""
    trace_id = secrets.token_hex(16)
    metadata = (("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),)
    try:
        return trace_id, grpc.StatusCode.OK, gateway.Predict(request, timeout=5, metadata=metadata)
    except grpc.RpcError as exc:
        return trace_id, exc.code(), None


def _record(mesh: Mesh, trace_id: str) -> dict[str, Any]:
    reader = ParquetReader(predictions_dir(mesh.state_dir))

    def found() -> dict[str, Any] | None:
        rows = reader.query(LogQuery(trace_id=trace_id)).rows
        return rows[0] if rows else None

    return wait_until(found, f"the record of trace {trace_id}")


def _log_query(capsys: pytest.CaptureFixture[str], mesh: Mesh, *args: str) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["log", "query", "--state-dir", str(mesh.state_dir), "--json", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]


def test_every_predict_through_the_edge_leaves_one_record(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    trace, code, reply = _traced_call(
        gateway, gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-42", "user-7"])
    )
    assert code == grpc.StatusCode.OK and reply is not None
    ok = _record(mesh, trace)
    assert ok["request_id"] == reply.request_id and ok["status"] == "OK"
    assert (ok["model"], ok["version"]) == ("fraud", reply.model_version)
    assert (ok["replica"], ok["zone"]) == (reply.model_replica, reply.model_zone)
    assert ok["replica"].startswith("model-") and ok["zone"] in mesh.spec.zones
    assert ok["gateway"].startswith("gateway-") and ok["gateway_zone"] in mesh.spec.zones
    assert ok["entities"] == {"user": ["user-42", "user-7"]}
    assert ok["outputs"] == {"score": [[pytest.approx(s, rel=1e-6)] for s in reply.scores]}
    assert 0 < ok["feature_ms"] + ok["inference_ms"] <= ok["total_ms"]
    assert ok["degraded"] is False and ok["message"] == ""

    row = demo_features(1)["user-0"].tolist()[:63]  # one feature short
    trace, code, _ = _traced_call(
        gateway,
        gateway_pb2.PredictRequest(model="fraud", rows=[gateway_pb2.FeatureRow(values=row)]),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    bad = _record(mesh, trace)
    assert bad["status"] == "INVALID_ARGUMENT" and bad["message"].startswith("rows[0].values")
    assert bad["feature_ms"] is None and bad["inference_ms"] is None and bad["replica"] == ""

    trace, code, _ = _traced_call(
        gateway, gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-99999999"])
    )
    assert code == grpc.StatusCode.NOT_FOUND
    missing = _record(mesh, trace)
    assert missing["status"] == "NOT_FOUND" and "user-99999999" in missing["message"]
    assert missing["entities"] == {"user": ["user-99999999"]}
    assert missing["feature_ms"] is not None and missing["inference_ms"] is None


def test_the_sre_questions_have_one_command_each(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub, capsys: pytest.CaptureFixture[str]
) -> None:
    customer = f"user-{secrets.randbelow(400) + 100}"
    traces = [
        _traced_call(gateway, gateway_pb2.PredictRequest(model="fraud", entity_ids=[customer]))[0]
        for _ in range(3)
    ]
    failed, code, _ = _traced_call(gateway, gateway_pb2.PredictRequest(model="nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    for trace in [*traces, failed]:
        _record(mesh, trace)  # written by now

    for_customer = _log_query(capsys, mesh, "--since", "1h", "--entity", f"user={customer}")
    assert {r["trace_id"] for r in for_customer} >= set(traces)
    assert all(f"user={customer}" in r["entity_keys"] for r in for_customer)

    errors = _log_query(capsys, mesh, "--since", "5m", "--errors")
    assert failed in {r["trace_id"] for r in errors}
    assert all(r["status"] != "OK" for r in errors)

    # The slowest 1% of today's calls (for this customer alone, so that calls of other
    # tests cannot land between the two queries): one call of three, the slowest.
    mine = ("--since", "1d", "--entity", f"user={customer}")
    slowest = _log_query(capsys, mesh, *mine, "--slowest", "1%")
    everything = _log_query(capsys, mesh, *mine)
    assert len(everything) >= 3 and len(slowest) == -(-len(everything) // 100)
    assert slowest[0]["total_ms"] == max(r["total_ms"] for r in everything)

    capsys.readouterr()
    assert main(["log", "status", "--state-dir", str(mesh.state_dir), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["rows"] >= len(everything) + 1 and status["files"] >= 1
    gateways = {g["gateway"] for g in status["gateways"]}
    assert gateways and all(g["dropped"] == 0 for g in status["gateways"])


async def test_a_full_buffer_drops_records_and_the_request_still_succeeds(mesh: Mesh) -> None:
    """A gateway of our own, whose store the test holds, in front of the mesh's listener."""
    store = BlockedStore()
    settings = PredictionLogSpec(buffer_records=2, flush_records=1, flush_interval_ms=60_000)
    predictions = PredictionLog(settings, store, CONTEXT)
    predictions.start()
    # Through the mesh listener as the mesh's own first gateway (mutual TLS, its certificate).
    caller = next(i for i in mesh.spec.instances() if i.service == "gateway")
    channel = dial_mesh(mesh.spec, caller.zone, caller=caller.name).aio_channel()
    server = ServiceServer("gateway-test", port=0)
    servicer = GatewayServicer(mesh.spec, channel, predictions=predictions)
    server.add_service(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, GATEWAY_SERVICE)
    port = await server.start()
    request = gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-42"])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as client:
            stub = gateway_pb2_grpc.GatewayStub(client)
            first = await stub.Predict(request, timeout=10)
            # The first record woke the writer, which is now stuck in the store.
            await asyncio.to_thread(store.entered.wait, 30)
            replies = [await stub.Predict(request, timeout=10) for _ in range(4)]
        assert first.scores and all(r.scores == first.scores for r in replies)
        stats = predictions.stats()
        assert (stats["accepted"], stats["dropped"], stats["written"]) == (3, 2, 0)
    finally:
        store.release.set()
        await server.drain()
        await channel.close()
        await predictions.close()
    assert predictions.stats()["written"] == 3 and len(store.rows) == 3
