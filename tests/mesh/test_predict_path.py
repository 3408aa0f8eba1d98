"""One prediction end to end: client -> Envoy edge -> gateway -> Envoy mesh -> feature/model."""

from __future__ import annotations

import io
import json
import time
import uuid

import grpc
import numpy as np
import pytest
import torch

from servemesh.contract.demo import demo_artifact, demo_features
from servemesh.identity import dial_service
from servemesh.launcher import Mesh
from servemesh.predlog.buffer import predictions_dir
from servemesh.predlog.query import LogQuery, ParquetReader
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.mesh.conftest import SLOW_MS, SLOW_VERSION
from tests.waiting import wait_until


def _torchscript_scores(seed: int, rows: np.ndarray) -> np.ndarray:
    model = torch.jit.load(io.BytesIO(demo_artifact(seed).data))
    with torch.inference_mode():
        return model(torch.from_numpy(rows)).numpy().reshape(-1)


def test_predict_through_the_mesh_equals_the_torchscript_model(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    features = demo_features(mesh.spec.demo.entities)
    entities = ["user-42", "user-7", "user-499"]
    reply = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=entities), timeout=5
    )
    expected = _torchscript_scores(1, np.stack([features[e] for e in entities]))
    assert reply.model_version == "v1"
    assert np.allclose(reply.scores, expected, rtol=1e-5, atol=1e-6)
    assert reply.request_id and not reply.degraded


def test_pinned_version_answers_with_that_version(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    row = demo_features(1)["user-0"]
    reply = gateway.Predict(
        gateway_pb2.PredictRequest(
            model="fraud", version="v2", rows=[gateway_pb2.FeatureRow(values=row.tolist())]
        ),
        timeout=5,
    )
    assert reply.model_version == "v2"
    assert reply.scores[0] == pytest.approx(
        float(_torchscript_scores(2, row[None, :])[0]), rel=1e-5
    )


def test_the_edge_s_request_id_follows_the_request_to_the_gateway(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    # The edge makes its own id (a caller's is not trusted) and the answer names it.
    callers_id = f"trace-{uuid.uuid4().hex}"
    reply = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"]),
        timeout=5,
        metadata=[("x-request-id", callers_id)],
    )
    assert reply.request_id and reply.request_id != callers_id
    # The gateway's record of the call carries it (a call that went well writes no log line).
    reader = ParquetReader(predictions_dir(mesh.state_dir))
    record = wait_until(
        lambda: reader.query(LogQuery(request_id=reply.request_id)).rows,
        f"the prediction log's record of {reply.request_id}",
    )
    assert record[0]["request_id"] == reply.request_id

    # Each Envoy on the way logs the call under that id, with where its time went.
    def logged() -> list[dict[str, object]] | None:
        found = [
            entry
            for path in mesh.logs_dir.glob("envoy-*-access.log")
            for line in path.read_text().splitlines()
            if (entry := _json_line(line)).get("request_id") == reply.request_id
        ]
        return found if len(found) >= 3 else None  # the edge, the feature and model hops

    for entry in wait_until(logged, f"the access log lines of {reply.request_id}"):
        envoy_in, upstream, envoy_out, whole_ms = (
            entry["envoy_in_us"],
            entry["upstream_us"],
            entry["envoy_out_us"],
            entry["ms"],
        )
        assert isinstance(envoy_in, int) and isinstance(envoy_out, int), entry
        assert isinstance(upstream, int) and isinstance(whole_ms, int), entry
        # The parts fit in the whole (`ms` is whole milliseconds, rounded down).
        assert 0 <= envoy_in + upstream + envoy_out < (whole_ms + 1) * 1000, entry


def _rows_computed(mesh: Mesh, version: str) -> int:
    """Rows every model replica has run through `version` (OIP statistics, inference_count)."""
    total = 0
    for inst in mesh.spec.instances():
        if inst.service != "model":
            continue
        with dial_service(mesh.spec, inst.name).channel() as channel:
            stats = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
                oip.ModelStatisticsRequest(name="fraud", version=version), timeout=2
            )
        total += sum(s.inference_count for s in stats.model_stats)
    return total


def _dropped_ids(mesh: Mesh) -> set[str]:
    """Request ids the model replicas logged as dropped."""
    ids = set()
    for path in mesh.logs_dir.glob("model-*.log"):
        for line in path.read_text().splitlines():
            if "dropped" in line:
                ids.add(str(_json_line(line).get("request_id", "")))
    return ids - {""}


def _edge_ids(mesh: Mesh, version: str) -> set[str]:
    """Request ids the edge gave to Predict calls that reached `version`'s replicas (the
    mesh listeners' access logs carry the gateway's call with the edge's id)."""
    ids = set()
    for path in mesh.logs_dir.glob("envoy-mesh-*-access.log"):
        for line in path.read_text().splitlines():
            entry = _json_line(line)
            if entry.get("version") == version:
                ids.add(str(entry.get("request_id", "")))
    return ids - {""}


def _json_line(line: str) -> dict[str, object]:
    """One JSON log line; {} for anything else (or a line still being written)."""
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def test_deadline_shorter_than_the_model_is_deadline_exceeded_and_the_replica_drops_it(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    # The edge names the request (a caller's id is not kept), so the drop is found as a
    # new id in the replicas' drop lines that the edge's access log shows as this call's.
    dropped_before = _dropped_ids(mesh)
    computed_before = _rows_computed(mesh, SLOW_VERSION)
    # Long enough to pass the gateway and the feature hop on a busy machine (a 50 ms one
    # ran out there once, and no replica saw the call), yet below one batch.
    timeout_s = (SLOW_MS - 20) / 1000
    started = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        gateway.Predict(
            gateway_pb2.PredictRequest(model="fraud", version=SLOW_VERSION, entity_ids=["user-3"]),
            timeout=timeout_s,
        )
    elapsed_ms = (time.perf_counter() - started) * 1000
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Answered at the caller's deadline; the slack is for a 2-core box with a busy core,
    # where the client's own timer can fire late.
    assert elapsed_ms < timeout_s * 1000 + 150, f"answered after {elapsed_ms:.0f} ms"

    # The replica refused to run it rather than computing a late answer (it knows a batch
    # takes SLOW_MS); the line may land a moment after the client gave up.
    def dropped() -> set[str]:
        return (_dropped_ids(mesh) - dropped_before) & _edge_ids(mesh, SLOW_VERSION)

    wait_until(dropped, "a replica to log dropping the late request")
    assert _rows_computed(mesh, SLOW_VERSION) == computed_before


def test_a_request_with_time_to_spare_still_gets_the_slow_model(
    mesh: Mesh, gateway: gateway_pb2_grpc.GatewayStub
) -> None:
    computed_before = _rows_computed(mesh, SLOW_VERSION)
    reply = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", version=SLOW_VERSION, entity_ids=["user-3"]),
        timeout=3,
    )
    assert reply.model_version == SLOW_VERSION
    assert _rows_computed(mesh, SLOW_VERSION) == computed_before + 1
