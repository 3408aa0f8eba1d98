"""What the fuzz campaign found, fixed, and held here on a real ServiceServer on loopback.

1. A body that is no message of the method's type answered UNKNOWN "Unexpected <class
   'google.protobuf.message.DecodeError'>: ..." (unary, server-streaming) or INTERNAL
   (client streams, where the decode happened inside the handler's loop).
2. A status message that echoes a huge name (70,000 characters) did not fit Envoy's header
   limit as a trailer: callers through Envoy got a reset. Messages are now bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from servemesh.services.runtime import ServiceServer
from servemesh.services.runtime.errors import MAX_WIRE_MESSAGE_CHARS, NotFound
from servemesh_api.gateway.v1 import gateway_pb2

SERVICE = "servemesh.test.Decode"
Request = gateway_pb2.PredictRequest
GOOD = Request(model="fraud", entity_ids=["user-1"]).SerializeToString()
# Field 1 (a string) claiming 2**31 bytes, then three: no PredictRequest.
CORRUPT = b"\x0a\x80\x80\x80\x80\x08abc"


async def echo_model(request: gateway_pb2.PredictRequest, context: object) -> bytes:
    if len(request.model) > 100:
        raise NotFound(f"model {request.model!r} is not served")
    return request.model.encode()


async def count(requests: AsyncIterator[gateway_pb2.PredictRequest], context: object) -> bytes:
    models = [request.model async for request in requests]
    return str(len(models)).encode()


async def stream_models(
    request: gateway_pb2.PredictRequest, context: object
) -> AsyncIterator[bytes]:
    yield request.model.encode()


def register(_: object, server: grpc.aio.Server) -> None:
    decode = Request.FromString
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(echo_model, request_deserializer=decode),
        "Upload": grpc.stream_unary_rpc_method_handler(count, request_deserializer=decode),
        "Stream": grpc.unary_stream_rpc_method_handler(stream_models, request_deserializer=decode),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = ServiceServer("decode", port=0, drain_grace_s=0.5)
    server.add_service(register, None, SERVICE)
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield chan
    await server.drain()


def assert_names_the_type(error: grpc.aio.AioRpcError) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "request: not a servemesh.gateway.v1.PredictRequest message"


async def test_an_undecodable_unary_body_is_invalid_argument_and_a_good_one_decodes(
    channel: grpc.aio.Channel,
) -> None:
    call = channel.unary_unary(f"/{SERVICE}/Unary")
    assert await call(GOOD, timeout=5) == b"fraud"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(CORRUPT, timeout=5)
    assert_names_the_type(caught.value)


async def test_an_undecodable_message_in_a_client_stream_is_invalid_argument(
    channel: grpc.aio.Channel,
) -> None:
    call = channel.stream_unary(f"/{SERVICE}/Upload")
    assert await call(iter([GOOD, GOOD]), timeout=5) == b"2"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(iter([GOOD, CORRUPT]), timeout=5)
    assert_names_the_type(caught.value)


async def test_an_undecodable_server_stream_request_is_invalid_argument(
    channel: grpc.aio.Channel,
) -> None:
    call = channel.unary_stream(f"/{SERVICE}/Stream")
    assert [m async for m in call(GOOD, timeout=5)] == [b"fraud"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _ = [m async for m in call(CORRUPT, timeout=5)]
    assert_names_the_type(caught.value)


async def test_a_status_message_echoing_a_huge_name_is_cut_to_the_bound(
    channel: grpc.aio.Channel,
) -> None:
    huge = Request(model="a" * 70_000).SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Unary")(huge, timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    details = caught.value.details()
    assert details.startswith("model 'aaaa")
    assert len(details) <= MAX_WIRE_MESSAGE_CHARS
    assert details.endswith("chars)")
