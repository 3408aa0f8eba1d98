"""Control calls need the mesh's control credential.

`wire.CONTROL_METHODS` (registry writes, model loads and unloads, feature writes) change
what the mesh serves. Every `ServiceServer` installs `ControlAuthInterceptor`, which answers
such a call only when it carries `authorization: Bearer <token>` with the token of the
mesh's state dir: UNAUTHENTICATED without one, PERMISSION_DENIED with a wrong one, before
the handler reads a single message. Every other method passes untouched. The token and the
header's value are never logged.
"""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from servemesh.control_credential import BEARER_PREFIX
from servemesh.services.runtime.interceptors import (
    StreamingBehaviour,
    UnaryBehaviour,
    with_stream_unary_behaviour,
    with_unary_behaviour,
    with_unary_stream_behaviour,
)
from servemesh.wire import AUTHORIZATION_HEADER, CONTROL_METHODS

log = logging.getLogger(__name__)

MISSING_MESSAGE = "control call: this method needs the mesh's control credential"
WRONG_MESSAGE = "control call: the control credential is not this mesh's"


def _presented(metadata: Any) -> str | None:
    """The bearer token a call carries, or None when it carries no bearer credential."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_HEADER and isinstance(value, str):
            if value.startswith(BEARER_PREFIX):
                return value[len(BEARER_PREFIX) :].strip()
            return None
    return None


class ControlAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses control calls that do not carry the mesh's control credential.

    `token` None (a service that found no credential) refuses every control call: a
    mesh without a credential accepts no changes rather than any.
    """

    def __init__(self, token: str | None = None) -> None:
        self.token = token

    def refusal(self, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        """The status a control call with `metadata` is refused with; None: let it in."""
        presented = _presented(metadata)
        if presented is None:
            return grpc.StatusCode.UNAUTHENTICATED, MISSING_MESSAGE
        expected = self.token
        if expected is None or not hmac.compare_digest(presented.encode(), expected.encode()):
            return grpc.StatusCode.PERMISSION_DENIED, WRONG_MESSAGE
        return None

    async def _check(self, context: grpc.aio.ServicerContext, method: str) -> None:
        refused = self.refusal(context.invocation_metadata())
        if refused is not None:
            code, message = refused
            # The method and the verdict only: never the header's value.
            log.warning("control call refused", extra={"method": method, "code": code.name})
            await context.abort(code, message)

    def _guarded_unary(self, behaviour: UnaryBehaviour, method: str) -> UnaryBehaviour:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._check(context, method)
            return await behaviour(request, context)

        return call

    def _guarded_streaming(self, behaviour: StreamingBehaviour, method: str) -> StreamingBehaviour:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await self._check(context, method)
            async for message in behaviour(request, context):
                yield message

        return call

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method not in CONTROL_METHODS:
            return handler
        if handler.unary_unary is not None:
            return with_unary_behaviour(handler, self._guarded_unary(handler.unary_unary, method))
        if handler.stream_unary is not None:
            return with_stream_unary_behaviour(
                handler, self._guarded_unary(handler.stream_unary, method)
            )
        if handler.unary_stream is not None:
            if inspect.isasyncgenfunction(handler.unary_stream):
                guarded = self._guarded_streaming(handler.unary_stream, method)
            else:  # a stream written with context.write: checked the same, before it runs
                guarded = self._guarded_unary(handler.unary_stream, method)  # type: ignore[assignment]
            return with_unary_stream_behaviour(handler, guarded)
        # A bidirectional control method would pass unchecked: refuse it outright instead.
        return _always_refused(handler)


def _always_refused(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "control call: not supported")

    return grpc.stream_stream_rpc_method_handler(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
