"""A bad row in a shared ModelInfer fails only its own Predict.

The gateway validates each Predict before it joins a shared call, so a row only a model
can refuse is the case left: here a model server of the test's own refuses any row whose
first value is 13 with INVALID_ARGUMENT. The first call is held until five more Predicts
wait behind it; they then leave as one call, which the model refuses for the one bad row,
and the gateway asks again member by member: the four good ones are answered, the bad one
gets the model's INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from servemesh.contract.demo import N_FEATURES
from servemesh.contract.wire import GATEWAY_SERVICE
from servemesh.services.gateway.service import PINNED, GatewayServicer
from servemesh.services.runtime import ServiceServer
from servemesh.spec import MeshSpec, ModelSpec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.waiting import wait_until_async

BAD = 13.0


class RefusingModel(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """Scores each row by its first value; refuses a call holding a row that starts with
    BAD; holds its first call until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.rows_per_call: list[int] = []

    async def ModelMetadata(  # noqa: N802 (the OIP method's name)
        self, request: oip.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelMetadataResponse:
        answer = oip.ModelMetadataResponse(name=request.name, versions=["v1"])
        answer.inputs.add(name="features", datatype="FP32", shape=[-1, N_FEATURES])
        answer.outputs.add(name="score", datatype="FP32", shape=[-1, 1])
        return answer

    async def ModelInfer(  # noqa: N802
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        rows = np.frombuffer(request.raw_input_contents[0], dtype="<f4").reshape(-1, N_FEATURES)
        self.rows_per_call.append(len(rows))
        if len(self.rows_per_call) == 1:
            await self.release.wait()
        if (rows[:, 0] == BAD).any():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a row starts with 13")
        answer = oip.ModelInferResponse(model_name=request.model_name, model_version="v1")
        answer.outputs.add(name="score", datatype="FP32", shape=[len(rows), 1])
        answer.raw_output_contents.append(rows[:, :1].astype("<f4").tobytes())
        return answer


@pytest.fixture
async def gateway() -> AsyncIterator[
    tuple[gateway_pb2_grpc.GatewayStub, GatewayServicer, RefusingModel]
]:
    model = RefusingModel()
    model_server = grpc.aio.server()
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(model, model_server)
    model_port = model_server.add_insecure_port("127.0.0.1:0")
    await model_server.start()
    spec = MeshSpec(models={"fraud": ModelSpec()})
    to_model = grpc.aio.insecure_channel(f"127.0.0.1:{model_port}")
    servicer = GatewayServicer(spec, to_model)
    # The gateway's own server (its call path maps a downstream failure to its status).
    gateway_server = ServiceServer("gateway-test", port=0)
    gateway_server.add_service(
        gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, GATEWAY_SERVICE
    )
    gateway_port = await gateway_server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway_port}") as channel:
            yield gateway_pb2_grpc.GatewayStub(channel), servicer, model
    finally:
        model.release.set()
        await gateway_server.drain()
        await to_model.close()
        await model_server.stop(None)


def _request(first_value: float) -> gateway_pb2.PredictRequest:
    values = [first_value] + [0.0] * (N_FEATURES - 1)
    return gateway_pb2.PredictRequest(
        model="fraud", version="v1", rows=[gateway_pb2.FeatureRow(values=values)]
    )


async def _predict(
    stub: gateway_pb2_grpc.GatewayStub, first_value: float
) -> gateway_pb2.PredictResponse | grpc.StatusCode:
    try:
        return await stub.Predict(_request(first_value), timeout=20)
    except grpc.aio.AioRpcError as exc:
        return exc.code()


async def test_a_row_the_model_refuses_fails_only_its_own_predict(
    gateway: tuple[gateway_pb2_grpc.GatewayStub, GatewayServicer, RefusingModel],
) -> None:
    stub, servicer, model = gateway
    # The gateway learns the signature first, so every Predict below goes straight to the
    # coalescer.
    first = asyncio.ensure_future(_predict(stub, 1.0))
    await wait_until_async(lambda: len(model.rows_per_call) == 1, "the first call to be held")
    key = ("fraud", id(servicer.spec.models["fraud"]), ("v1", PINNED, PINNED), ((N_FEATURES,),))
    values = [2.0, 3.0, BAD, 4.0, 5.0]
    behind = [asyncio.ensure_future(_predict(stub, v)) for v in values]
    await wait_until_async(
        lambda: servicer.model_calls.pending(key) == len(values), "five Predicts to wait"
    )
    model.release.set()
    answers = [await first, *[await b for b in behind]]
    # The held call, then the five together (refused), then each of the five alone.
    assert model.rows_per_call[:2] == [1, 5] and sorted(model.rows_per_call[2:]) == [1] * 5
    assert answers[3] == grpc.StatusCode.INVALID_ARGUMENT
    good = [a for i, a in enumerate(answers) if i != 3]
    assert all(isinstance(a, gateway_pb2.PredictResponse) for a in good)
    assert [a.scores[0] for a in good] == [1.0, 2.0, 3.0, 4.0, 5.0]
