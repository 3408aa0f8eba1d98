"""Request bodies are decoded inside the call, so a body that is no message of the
method's type is INVALID_ARGUMENT naming the type, like any other bad input.

Left to grpc.aio, a protobuf DecodeError in the request deserializer answers UNKNOWN
"Unexpected <class 'google.protobuf.message.DecodeError'>: ..." (an internal class name
on the wire), and one in a client stream's iterator surfaces in the handler as a bug
(INTERNAL). This interceptor gives the handler identity deserialization and decodes each
body itself, raising InvalidArgument, which ErrorStatusInterceptor (outside it) answers.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from servemesh.services.runtime.errors import InvalidArgument
from servemesh.services.runtime.interceptors import StreamingBehaviour, UnaryBehaviour

Decode = Callable[[bytes], Any]


def _decoder(deserializer: Decode) -> Decode:
    def decode(body: bytes) -> Any:
        try:
            return deserializer(body)
        except Exception:  # DecodeError, or a deserializer's own refusal
            name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
            what = f"a {name.full_name} message" if name is not None else "a valid message"
            raise InvalidArgument(f"request: not {what}") from None

    return decode


def _unary(behaviour: UnaryBehaviour, decode: Decode) -> UnaryBehaviour:
    async def call(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(decode(request), context)

    return call


def _client_stream(behaviour: UnaryBehaviour, decode: Decode) -> UnaryBehaviour:
    async def call(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        async def messages() -> AsyncIterator[Any]:
            async for body in requests:
                yield decode(body)

        return await behaviour(messages(), context)

    return call


def _server_stream(behaviour: StreamingBehaviour, decode: Decode) -> StreamingBehaviour:
    async def call(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for message in behaviour(decode(request), context):
            yield message

    return call


class DecodeRequestInterceptor(grpc.aio.ServerInterceptor):
    """Decodes request bodies in the call: a bad body is INVALID_ARGUMENT, never UNKNOWN."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode = _decoder(handler.request_deserializer)
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, decode), response_serializer=serialize
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _client_stream(handler.stream_unary, decode), response_serializer=serialize
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                _server_stream(handler.unary_stream, decode), response_serializer=serialize
            )
        # Streams written with context.write and bidirectional streams (reflection): as is.
        return handler
