"""The one error tree reaches callers as gRPC statuses, through a real server on loopback."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from servemesh.services.runtime import ServiceServer
from servemesh.services.runtime.deadlines import DeadlineExhausted
from servemesh.services.runtime.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

SERVICE = "servemesh.test.Errors"
TREE: list[tuple[type[MeshError], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExhausted, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (DataLoss, grpc.StatusCode.DATA_LOSS),
]
BY_NAME = {kind.__name__: kind for kind, _ in TREE}


class AlreadyLogged(ResourceExhausted):
    logged_at_source = True


async def raise_named(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """Raises the tree class the request names, with a message naming a field."""
    name = request.decode()
    if name == "bug":
        raise KeyError("secret-internal-detail")
    if name == "logged":
        raise AlreadyLogged("field: the raiser logged this one")
    if name == "explicit":
        raise MeshError("field: told explicitly", code=grpc.StatusCode.PERMISSION_DENIED)
    raise BY_NAME[name](f"field: {name}")


async def stream_then_fail(
    request: bytes, context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    yield b"first"
    raise NotFound("chunk: gone after the first")


async def upload(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    async for _ in requests:
        raise InvalidArgument("header: the first message must carry it")
    return b""


def register(_: object, server: grpc.aio.Server) -> None:
    handlers = {
        "Raise": grpc.unary_unary_rpc_method_handler(raise_named),
        "Stream": grpc.unary_stream_rpc_method_handler(stream_then_fail),
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = ServiceServer("errors", port=0, drain_grace_s=0.5)
    server.add_service(register, None, SERVICE)
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield chan
    await server.drain()


@pytest.mark.parametrize(("kind", "code"), TREE, ids=[k.__name__ for k, _ in TREE])
async def test_each_error_class_reaches_the_caller_as_its_status(
    channel: grpc.aio.Channel, kind: type[MeshError], code: grpc.StatusCode
) -> None:
    call = channel.unary_unary(f"/{SERVICE}/Raise")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(kind.__name__.encode(), timeout=5)
    assert caught.value.code() == code
    assert caught.value.details() == f"field: {kind.__name__}"


async def test_an_explicit_code_overrides_the_class_default(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Raise")(b"explicit", timeout=5)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_an_unexpected_exception_is_internal_without_its_details(
    channel: grpc.aio.Channel,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Raise")(b"bug", timeout=5)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details() == "internal error"
    assert "secret" not in (caught.value.debug_error_string() or "")


async def test_a_stream_that_fails_midway_ends_with_the_errors_status(
    channel: grpc.aio.Channel,
) -> None:
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for message in channel.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=5):
            received.append(message)
    assert received == [b"first"]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_client_stream_refusal_reaches_the_caller(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.stream_unary(f"/{SERVICE}/Upload")(iter([b"x"]), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("header:")


async def test_a_refusal_is_logged_once_and_never_twice(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="servemesh.services.runtime.errors")
    call = channel.unary_unary(f"/{SERVICE}/Raise")
    for name in ("NotFound", "logged"):
        with pytest.raises(grpc.aio.AioRpcError):
            await call(name.encode(), timeout=5)
    refused = [r for r in caplog.records if r.getMessage() == "call refused"]
    # The interceptor logs the plain refusal; the one its raiser logged is not logged again.
    assert [vars(r)["reason"] for r in refused] == ["field: NotFound"]
