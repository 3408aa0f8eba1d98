"""Helpers for server interceptors that wrap the handler of a call: the same (de)serialisers,
another behaviour."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

# A call answered with one message (the request: one message, or an iterator of them).
UnaryBehaviour = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
# A call answered with a stream of messages, written as an async generator.
StreamingBehaviour = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


def with_unary_behaviour(
    handler: grpc.RpcMethodHandler, behaviour: UnaryBehaviour
) -> grpc.RpcMethodHandler:
    """The same handler (same (de)serialisers) running `behaviour` instead."""
    return grpc.unary_unary_rpc_method_handler(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def with_stream_unary_behaviour(
    handler: grpc.RpcMethodHandler, behaviour: UnaryBehaviour
) -> grpc.RpcMethodHandler:
    """The same client-streaming handler running `behaviour` instead."""
    return grpc.stream_unary_rpc_method_handler(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def with_unary_stream_behaviour(
    handler: grpc.RpcMethodHandler, behaviour: StreamingBehaviour
) -> grpc.RpcMethodHandler:
    """The same server-streaming handler running `behaviour` instead."""
    return grpc.unary_stream_rpc_method_handler(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
