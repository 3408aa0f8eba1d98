"""The server interceptor chain services had before the call path (call_path.py), rebuilt
for the unary path over the same steps, so the bench compares the two in one run.

Six grpc.aio server interceptors, outermost first: server span, metrics, control
credential, faults, error statuses, request decoding. Each one, on every call, awaits the
next one's handler and builds a new handler around its behaviour, as they did; the
metrics are prometheus_client's labelled children, as they were.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from servemesh.services.runtime.call_path import failure_code
from servemesh.services.runtime.control_auth import ControlAuth, is_control
from servemesh.services.runtime.decode import decoder
from servemesh.services.runtime.errors import answer_failure
from servemesh.services.runtime.faults import FaultInjector, is_faultable
from servemesh.services.runtime.interceptors import UnaryBehaviour, with_unary_behaviour
from servemesh.services.runtime.metrics import RPC_BUCKETS, code_of
from servemesh.services.runtime.tracing import (
    close_server_span,
    is_traced,
    open_server_span,
    span_name,
)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]
Wrapper = Callable[[UnaryBehaviour, grpc.HandlerCallDetails], UnaryBehaviour | None]


class _Unary(grpc.aio.ServerInterceptor):
    """Rebuilds a unary handler around `wrapper(behaviour, details)` on every call."""

    def __init__(self, wrapper: Wrapper) -> None:
        self.wrapper = wrapper

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        behaviour = self.wrapper(handler.unary_unary, details)
        return handler if behaviour is None else with_unary_behaviour(handler, behaviour)


def _traced(inner: UnaryBehaviour, details: grpc.HandlerCallDetails) -> UnaryBehaviour | None:
    if not is_traced(details.invocation_metadata):
        return None  # the caller's trace is not sampled: the handler runs untouched
    return server_span_around(span_name(details.method), inner)


def server_span_around(name: str, inner: UnaryBehaviour) -> UnaryBehaviour:
    """`inner` inside its call's server span named `name` (the tracing step alone)."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        span = open_server_span(name, context)
        error: BaseException | None = None
        try:
            return await inner(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if span is not None:
                close_server_span(span, context, error)

    return call


class _LabelledMetrics:
    """The RPC metrics as services kept them: prometheus_client's labelled children (a
    lock per update), bound once per method."""

    def __init__(self, service: str) -> None:
        self.service = service
        registry = CollectorRegistry()
        self.requests = Counter(
            "rpc_requests", "", ["service", "method", "code"], registry=registry
        )
        self.duration = Histogram(
            "rpc_duration_seconds",
            "",
            ["service", "method"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge("rpc_in_flight", "", ["service", "method"], registry=registry)
        self.bound: dict[str, tuple[Any, Any, dict[str, Any]]] = {}

    def method(self, method: str) -> tuple[Any, Any, dict[str, Any]]:
        found = self.bound.get(method)
        if found is None:
            found = self.bound[method] = (
                self.duration.labels(self.service, method),
                self.in_flight.labels(self.service, method),
                {},
            )
        return found

    def count(self, method: str, by_code: dict[str, Any], code: str) -> None:
        child = by_code.get(code)
        if child is None:
            child = by_code[code] = self.requests.labels(self.service, method, code)
        child.inc()


def _timed(metrics: _LabelledMetrics) -> Wrapper:
    def wrapper(inner: UnaryBehaviour, details: grpc.HandlerCallDetails) -> UnaryBehaviour:
        method = details.method
        duration, in_flight, by_code = metrics.method(method)

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            in_flight.inc()
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                answer = await inner(request, context)
                code = code_of(context)
                return answer
            except BaseException as exc:
                code = failure_code(exc, context)
                raise
            finally:
                duration.observe(time.perf_counter() - started)
                in_flight.dec()
                metrics.count(method, by_code, code)

        return call

    return wrapper


def _checked(control: ControlAuth) -> Wrapper:
    def wrapper(inner: UnaryBehaviour, details: grpc.HandlerCallDetails) -> UnaryBehaviour | None:
        if not is_control(details.method):
            return None

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await control.check(context, details.method)
            return await inner(request, context)

        return call

    return wrapper


def _faulty(faults: FaultInjector) -> Wrapper:
    def wrapper(inner: UnaryBehaviour, details: grpc.HandlerCallDetails) -> UnaryBehaviour | None:
        if not faults.settings.active or not is_faultable(details.method):
            return None

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if faults.settings.active:
                await faults.inject(context)
            return await inner(request, context)

        return call

    return wrapper


def _mapped(inner: UnaryBehaviour, details: grpc.HandlerCallDetails) -> UnaryBehaviour:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await inner(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await answer_failure(exc, context, details.method)

    return call


class _Decode(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.unary_unary is None:
            return handler
        decode = decoder(handler.request_deserializer)
        inner = handler.unary_unary

        async def call(request: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await inner(decode(request), context)

        return grpc.unary_unary_rpc_method_handler(
            call, response_serializer=handler.response_serializer
        )


def legacy_interceptors(service: str = "bench") -> list[grpc.aio.ServerInterceptor]:
    """The chain, outermost first, as ServiceServer installed it."""
    return [
        _Unary(_traced),
        _Unary(_timed(_LabelledMetrics(service))),
        _Unary(_checked(ControlAuth(None))),
        _Unary(_faulty(FaultInjector())),
        _Unary(_mapped),
        _Decode(),
    ]
