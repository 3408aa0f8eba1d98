"""A steady Predict (or OIP ModelInfer) load through a running mesh's edge, for the tests
that break one of its Envoys (or its zones' network) under traffic and watch which zones
keep answering."""

from __future__ import annotations

import grpc

from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.load import BackgroundLoad, predict_target
from servemesh.load.outcome import Reply, Request
from servemesh.load.target import Target
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc


def edge_load(mesh: Mesh, rate_per_s: float = 40.0) -> BackgroundLoad:
    """An open loop of Predicts for the demo's first 50 entities (5 s deadline each), not
    started yet."""
    target = predict_target(dial_edge(mesh.spec), entities=50, timeout_s=5.0)
    return BackgroundLoad(target, rate_per_s=rate_per_s)


def zones_answering(load: BackgroundLoad, since_s: float = 0.0) -> set[str]:
    """The zones whose gateways answered calls sent from `since_s` on."""
    return {o.zone for o in load.run.window(since_s) if o.ok}


def oip_edge_load(mesh: Mesh, rate_per_s: float = 40.0) -> BackgroundLoad:
    """An open loop of OIP ModelInfer calls for the demo's fraud model (one row of zeros,
    5 s deadline each) through the edge, not started yet."""
    dial = dial_edge(mesh.spec)
    with dial.channel() as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        described = stub.ModelMetadata(oip.ModelMetadataRequest(name="fraud"), timeout=10.0)
    [tensor] = described.inputs
    width = int(tensor.shape[-1])
    request = oip.ModelInferRequest(model_name="fraud")
    row = request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=[1, width])
    row.contents.fp32_contents.extend([0.0] * width)

    def build(channel: grpc.aio.Channel) -> Request:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def infer(index: int) -> Reply:
            answer = await stub.ModelInfer(request, timeout=5.0)
            return Reply(version=answer.model_version)

        return infer

    target = Target(dial.address, build, dial.options, dial.credentials)
    return BackgroundLoad(target, rate_per_s=rate_per_s)
