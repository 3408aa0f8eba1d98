"""The call path every ServiceServer wraps its methods in, through a real server on
loopback: injected faults from the control file, the service's own interceptors (inside
the decoding and the error mapping), and the statuses the metrics count."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.services.runtime import ServiceServer
from servemesh.services.runtime.errors import NotFound
from servemesh.services.runtime.faults import FaultSettings, control_file, set_fault
from servemesh.services.runtime.interceptors import with_unary_behaviour
from tests.waiting import wait_until_async

SERVICE = "servemesh.test.Path"
ECHO = f"/{SERVICE}/Echo"
# A protobuf message type, so an undecodable body has a type to be named after.
Message: TypeAlias = health_pb2.HealthCheckRequest


async def echo(request: Message, context: grpc.aio.ServicerContext) -> Message:
    if request.service == "missing":
        raise NotFound("service: no such thing")
    if request.service == "chosen":
        context.set_code(grpc.StatusCode.ALREADY_EXISTS)
    return Message(service="echo:" + request.service)


def register(_: object, server: grpc.aio.Server) -> None:
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(
            echo,
            request_deserializer=Message.FromString,
            response_serializer=Message.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class Recorder(grpc.aio.ServerInterceptor):
    """A service's own interceptor: records what its handler saw (requests, exceptions)
    and the `x-tag` metadata of the call, decided per call as ShadowRecorder does."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        tag = dict(details.invocation_metadata or ()).get("x-tag")
        if handler is None or tag is None or handler.unary_unary is None:
            return handler
        behaviour = handler.unary_unary

        async def recorded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                answer = await behaviour(request, context)
            except Exception as exc:
                self.seen.append((tag, type(exc).__name__))
                raise
            self.seen.append((tag, request))
            return answer

        return with_unary_behaviour(handler, recorded)


Served = tuple[ServiceServer, grpc.aio.Channel, Recorder]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    recorder = Recorder()
    server = ServiceServer("path", port=0, drain_grace_s=0.5, interceptors=[recorder])
    server.add_service(register, None, SERVICE)
    server.watch_faults(control_file(tmp_path, "path"))
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield server, channel, recorder
    await server.drain()


def _echo(channel: grpc.aio.Channel) -> Any:
    return channel.unary_unary(
        ECHO, request_serializer=Message.SerializeToString, response_deserializer=Message.FromString
    )


def _calls(server: ServiceServer, code: str) -> float:
    value = server.metrics.registry.get_sample_value(
        "servemesh_rpc_requests_total", {"service": "path", "method": ECHO, "code": code}
    )
    return value or 0.0


async def test_the_service_interceptors_see_decoded_requests_and_the_handlers_errors(
    served: Served,
) -> None:
    server, channel, recorder = served
    answer = await _echo(channel)(Message(service="a"), metadata=[("x-tag", "one")], timeout=5)
    assert answer.service == "echo:a"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _echo(channel)(Message(service="missing"), metadata=[("x-tag", "two")], timeout=5)
    # The error mapping lies outside them: they see the MeshError, the caller its status.
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == "service: no such thing"
    # Decided per call: a call without the tag is not recorded.
    await _echo(channel)(Message(service="b"), timeout=5)
    assert recorder.seen == [("one", Message(service="a")), ("two", "NotFound")]


async def test_metrics_count_each_call_by_the_status_its_caller_saw(served: Served) -> None:
    server, channel, _ = served
    await _echo(channel)(Message(service="a"), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError):
        await _echo(channel)(Message(service="missing"), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _echo(channel)(Message(service="chosen"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS  # chosen by the handler
    with pytest.raises(grpc.aio.AioRpcError) as undecodable:
        await channel.unary_unary(ECHO)(b"\xff\xff\xff", timeout=5)
    assert undecodable.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc.health.v1.HealthCheckRequest" in (undecodable.value.details() or "")

    def counted() -> dict[str, float]:
        return {
            code: _calls(server, code)
            for code in ("OK", "NOT_FOUND", "ALREADY_EXISTS", "INVALID_ARGUMENT")
        }

    # A call is counted as its handler ends, which may come just after its caller has the
    # status: wait for the four, then check no call was counted twice.
    expected = {"OK": 1, "NOT_FOUND": 1, "ALREADY_EXISTS": 1, "INVALID_ARGUMENT": 1}

    def in_flight() -> float | None:
        return server.metrics.registry.get_sample_value(
            "servemesh_rpc_in_flight", {"service": "path", "method": ECHO}
        )

    await wait_until_async(
        lambda: counted() == expected and in_flight() == 0, "each call counted once, none open"
    )
    assert counted() == expected


async def test_an_injected_error_answers_every_call_but_health_checks(
    served: Served, tmp_path: Path
) -> None:
    server, channel, recorder = served
    await set_fault_async(tmp_path, FaultSettings(error_percent=100, error_code="UNAVAILABLE"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _echo(channel)(Message(service="a"), metadata=[("x-tag", "x")], timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details() == "injected fault"
    assert recorder.seen == []  # the fault comes before the handler and what wraps it
    assert server.faults.faulted == 1
    # Counted as the handler ends, which may come just after the caller has the status.
    await wait_until_async(lambda: _calls(server, "UNAVAILABLE") == 1, "the faulted call counted")
    assert _calls(server, "UNAVAILABLE") == 1
    # Health checks are never faulted: only outlier detection can catch a faulty replica.
    health = health_pb2_grpc.HealthStub(channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await set_fault_async(tmp_path, None)
    assert (await _echo(channel)(Message(service="a"), timeout=5)).service == "echo:a"


async def test_an_injected_delay_holds_each_call(served: Served, tmp_path: Path) -> None:
    _, channel, _ = served
    await set_fault_async(tmp_path, FaultSettings(delay_percent=100, delay_ms=150))
    started = time.monotonic()
    assert (await _echo(channel)(Message(service="a"), timeout=5)).service == "echo:a"
    assert time.monotonic() - started >= 0.15


async def set_fault_async(state_dir: Path, settings: FaultSettings | None) -> None:
    """set_fault waits (blocking) for the replica's acknowledgement: off the loop."""
    await asyncio.to_thread(set_fault, state_dir, "path", settings)
