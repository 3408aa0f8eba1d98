"""The path every call of a `ServiceServer` takes, built once per method.

In this order, outermost first (each step sees what the ones beneath it did):

1. the server span (tracing.py): only when this process records and the caller's trace is
   sampled or new; it covers every refusal below;
2. metrics (metrics.py): calls by method and status, latency, in flight;
3. the control credential (control_auth.py), for control methods only;
4. injected faults (faults.py), for unary methods other than health and reflection, only
   while a fault is set;
5. error statuses (errors.py): a MeshError becomes its status, anything else INTERNAL;
6. request decoding (decode.py): an undecodable body is INVALID_ARGUMENT;
7. the service's own grpc.aio server interceptors, if it passed any, then the handler.

grpc.aio's own server interceptors cost a call about 50 µs of CPU by merely being there
(each one is a coroutine and a partial per call, and each rebuilt the method's handler
per call); here the handler of a method is wrapped once, when the service registers it
(`PathServer`), and a call runs one coroutine that does each step inline.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from servemesh.services.runtime.control_auth import UNSUPPORTED_MESSAGE, ControlAuth, is_control
from servemesh.services.runtime.decode import Decode, decoded, decoder
from servemesh.services.runtime.errors import answer_failure
from servemesh.services.runtime.faults import FaultInjector, is_faultable
from servemesh.services.runtime.metrics import ServiceMetrics, code_of
from servemesh.services.runtime.tracing import close_server_span, open_server_span, span_name

Behaviour = Callable[..., Any]
Wrap = Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]


def failure_code(error: BaseException, context: grpc.aio.ServicerContext) -> str:
    """The status a call that raised `error` ends with, as metrics count it."""
    if isinstance(error, grpc.aio.AbortError):
        return code_of(context)  # the status the abort sent
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "UNKNOWN"  # escaped every step: grpc answers UNKNOWN


class _Details:
    """What a grpc.aio server interceptor is given about a call."""

    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str, invocation_metadata: Any) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


class CallPath:
    """Wraps the handler of each method of a server in the steps above (see `wrap`)."""

    def __init__(
        self,
        *,
        metrics: ServiceMetrics,
        control: ControlAuth,
        faults: FaultInjector,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.metrics = metrics
        self.control = control
        self.faults = faults
        self.interceptors = tuple(interceptors)

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` of `method` ("/pkg.Service/Method") with the call path around it."""
        decode = decoder(handler.request_deserializer) if handler.request_deserializer else None
        response = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler, "unary_unary", decode, faulted=True),
                response_serializer=response,
                request_deserializer=None if decode else handler.request_deserializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(method, handler, "stream_unary", decode, faulted=False),
                response_serializer=response,
                request_deserializer=None if decode else handler.request_deserializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                self._server_stream(method, handler, decode),
                response_serializer=response,
                request_deserializer=None if decode else handler.request_deserializer,
            )
        # Streams written with context.write and bidirectional streams (reflection) run as
        # they are; a control method among them is checked, or refused outright.
        if not is_control(method):
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._checked(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=response,
            )
        return grpc.stream_stream_rpc_method_handler(
            _refused,
            request_deserializer=handler.request_deserializer,
            response_serializer=response,
        )

    async def _behaviour(
        self, method: str, handler: grpc.RpcMethodHandler, kind: str, context: Any
    ) -> Behaviour:
        """The handler's behaviour as the service's own interceptors (run per call: they
        decide by the call's metadata) make it."""
        behaviour: Behaviour = getattr(handler, kind)
        if not self.interceptors:
            return behaviour
        details = _Details(method, context.invocation_metadata())
        chain = iter(self.interceptors)

        async def continuation(_: Any) -> grpc.RpcMethodHandler:
            following = next(chain, None)
            if following is None:
                return handler
            return await following.intercept_service(continuation, details)

        intercepted = await continuation(details)
        return getattr(intercepted, kind) if intercepted is not None else behaviour

    def _unary(
        self,
        method: str,
        handler: grpc.RpcMethodHandler,
        kind: str,
        decode: Decode | None,
        *,
        faulted: bool,
    ) -> Behaviour:
        """A call answered with one message: unary, or client-streaming (`kind`)."""
        name = span_name(method)
        metrics = self.metrics
        control = self.control if is_control(method) else None
        faults = self.faults if faulted and is_faultable(method) else None
        streamed = kind == "stream_unary"
        plain: Behaviour | None = None if self.interceptors else getattr(handler, kind)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = open_server_span(name, context)
            bound = metrics.method(method)
            started = bound.begin()
            code = "UNKNOWN"
            error: BaseException | None = None
            try:
                if control is not None:
                    await control.check(context, method)
                if faults is not None and faults.settings.active:
                    await faults.inject(context)
                try:
                    if decode is not None:
                        request = decoded(request, decode) if streamed else decode(request)
                    behaviour = plain or await self._behaviour(method, handler, kind, context)
                    answer = await behaviour(request, context)
                except grpc.aio.AbortError:
                    raise  # the handler chose its status
                except Exception as exc:
                    await answer_failure(exc, context, method)
                code = code_of(context)
                return answer
            except BaseException as exc:
                error = exc
                code = failure_code(exc, context)
                raise
            finally:
                bound.end(started, code)
                if span is not None:
                    close_server_span(span, context, error)

        return call

    def _server_stream(
        self, method: str, handler: grpc.RpcMethodHandler, decode: Decode | None
    ) -> Behaviour:
        """A call answered with a stream of messages (an async generator handler)."""
        name = span_name(method)
        metrics = self.metrics
        control = self.control if is_control(method) else None

        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            span = open_server_span(name, context)
            bound = metrics.method(method)
            started = bound.begin()
            code = "UNKNOWN"
            error: BaseException | None = None
            try:
                if control is not None:
                    await control.check(context, method)
                try:
                    if decode is not None:
                        request = decode(request)
                    behaviour = await self._behaviour(method, handler, "unary_stream", context)
                    async for message in behaviour(request, context):
                        yield message
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await answer_failure(exc, context, method)
                code = code_of(context)
            except BaseException as exc:
                error = exc
                code = failure_code(exc, context)
                raise
            finally:
                bound.end(started, code)
                if span is not None:
                    close_server_span(span, context, error)

        return call

    def _checked(self, method: str, behaviour: Behaviour) -> Behaviour:
        """A control stream written with context.write: checked before it runs."""
        control = self.control

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await control.check(context, method)
            return await behaviour(request, context)

        return call


async def _refused(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    # A bidirectional control method would pass unchecked: it is refused outright.
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, UNSUPPORTED_MESSAGE)


class _WrappedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose answers run through the call path, each method's handler
    wrapped once (on its first call) and reused while the inner handler returns the same."""

    # Generic handlers answer only the methods they know; a catch-all one (none here)
    # would otherwise let callers grow this cache with made-up method names.
    MAX_CACHED = 1024

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Wrap) -> None:
        self._inner = inner
        self._wrap = wrap
        self._cache: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._cache.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        if len(self._cache) < self.MAX_CACHED:
            self._cache[method] = (handler, wrapped)
        return wrapped


class PathServer(grpc.aio.Server):
    """A grpc.aio server whose every method, however registered (generated
    add_*_to_server, generic handlers, health, reflection), runs through `wrap`."""

    def __init__(self, server: grpc.aio.Server, wrap: Wrap) -> None:
        self._server = server
        self._wrap = wrap

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[Any]) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_WrappedGeneric(handler, self._wrap) for handler in generic_rpc_handlers)
        )

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self._server.add_registered_method_handlers(
            service_name,
            {
                name: self._wrap(f"/{service_name}/{name}", handler)
                for name, handler in method_handlers.items()
            },
        )

    def add_insecure_port(self, address: str) -> int:
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._server.add_secure_port(address, server_credentials)

    async def start(self) -> None:
        await self._server.start()

    async def stop(self, grace: float | None) -> None:
        await self._server.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self._server.wait_for_termination(timeout)
