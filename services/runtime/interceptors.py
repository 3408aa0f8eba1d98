"""Helpers for server interceptors that wrap the unary handler of a call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

UnaryBehaviour = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def with_unary_behaviour(
    handler: grpc.RpcMethodHandler, behaviour: UnaryBehaviour
) -> grpc.RpcMethodHandler:
    """The same handler (same (de)serialisers) running `behaviour` instead."""
    return grpc.unary_unary_rpc_method_handler(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
