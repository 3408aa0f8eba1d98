"""Control calls need the control credential: every ServiceServer checks it, for unary,
client-streaming and server-streaming handlers alike, through a real server on loopback.

The handlers here sit at control method paths (`wire.CONTROL_METHODS`); the interceptor
goes by the path alone, so raw-bytes handlers stand for the real services, and each counts
the calls that reached it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from servemesh.contract.control_credential import (
    ControlCredentialMissing,
    control_metadata,
    control_metadata_for,
    control_token_path,
    ensure_control_token,
    read_control_token,
)
from servemesh.contract.wire import (
    CONTROL_METHODS,
    FEATURE_SERVICE,
    OIP_SERVICE,
    REGISTRY_SERVICE,
    method_path,
)
from servemesh.services.runtime import ServiceServer
from tests.control_kit import TEST_CREDENTIAL, TEST_TOKEN

MISSING = "control call: this method needs the mesh's control credential"
UNARY = method_path(FEATURE_SERVICE, "WriteFeatures")
CLIENT_STREAMING = method_path(FEATURE_SERVICE, "LoadFeatures")
# No control method streams its answer today; the check must hold for one that would.
SERVER_STREAMING = method_path(OIP_SERVICE, "RepositoryModelUnload")
NOT_CONTROL = method_path(REGISTRY_SERVICE, "ListModels")


class Handlers:
    """Raw-bytes handlers at control paths, counting the calls that reached them."""

    def __init__(self) -> None:
        self.reached: list[str] = []

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.reached.append("unary")
        return b"done:" + request

    async def client_streaming(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> bytes:
        self.reached.append("client-streaming")
        return b"".join([chunk async for chunk in requests])

    async def server_streaming(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        self.reached.append("server-streaming")
        yield b"one"
        yield b"two"

    def register(self, _: object, server: grpc.aio.Server) -> None:
        def service(path: str) -> tuple[str, str]:
            name, _, method = path.strip("/").rpartition("/")
            return name, method

        table = {
            UNARY: grpc.unary_unary_rpc_method_handler(self.unary),
            CLIENT_STREAMING: grpc.stream_unary_rpc_method_handler(self.client_streaming),
            SERVER_STREAMING: grpc.unary_stream_rpc_method_handler(self.server_streaming),
            NOT_CONTROL: grpc.unary_unary_rpc_method_handler(self.unary),
        }
        by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for path, handler in table.items():
            name, method = service(path)
            by_service.setdefault(name, {})[method] = handler
        server.add_generic_rpc_handlers(
            tuple(grpc.method_handlers_generic_handler(n, h) for n, h in by_service.items())
        )


@pytest.fixture
async def served() -> AsyncIterator[tuple[grpc.aio.Channel, Handlers]]:
    handlers = Handlers()
    server = ServiceServer("control", port=0, drain_grace_s=0.5, control_token=TEST_TOKEN)
    server.add_service(handlers.register, None, "control")
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel, handlers
    await server.drain()


async def call_kind(
    channel: grpc.aio.Channel, kind: str, metadata: object, *, refused: bool = False
) -> bytes:
    """One call of `kind`. A call expected to be `refused` streams no message: the server
    refuses it from its metadata, and a message still being sent when it does fails in the
    client as INTERNAL ("Failed execute_batch"), hiding the server's status."""
    if kind == "unary":
        answer: bytes = await channel.unary_unary(UNARY)(b"x", metadata=metadata, timeout=10)
        return answer
    if kind == "client-streaming":

        async def chunks() -> AsyncIterator[bytes]:
            for chunk in () if refused else (b"a", b"b"):
                yield chunk

        answer = await channel.stream_unary(CLIENT_STREAMING)(
            chunks(), metadata=metadata, timeout=10
        )
        return answer
    call = channel.unary_stream(SERVER_STREAMING)(b"x", metadata=metadata, timeout=10)
    return b"".join([message async for message in call])


KINDS = ["unary", "client-streaming", "server-streaming"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_control_call_without_the_credential_is_unauthenticated_and_reaches_nothing(
    served: tuple[grpc.aio.Channel, Handlers], kind: str
) -> None:
    channel, handlers = served
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call_kind(channel, kind, (), refused=True)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details() == MISSING
    assert handlers.reached == []


@pytest.mark.parametrize("kind", KINDS)
async def test_a_control_call_with_a_wrong_credential_is_permission_denied(
    served: tuple[grpc.aio.Channel, Handlers],
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel, handlers = served
    wrong = TEST_TOKEN[:-1] + "X"
    with caplog.at_level(logging.DEBUG), pytest.raises(grpc.aio.AioRpcError) as caught:
        await call_kind(channel, kind, control_metadata(wrong), refused=True)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert wrong not in (caught.value.details() or "")
    assert handlers.reached == []
    # The refusal is logged with the method, never with the header's value.
    assert "control call refused" in caplog.text
    assert wrong not in caplog.text and TEST_TOKEN not in caplog.text


@pytest.mark.parametrize("kind", KINDS)
async def test_a_control_call_with_the_credential_reaches_its_handler(
    served: tuple[grpc.aio.Channel, Handlers], kind: str
) -> None:
    channel, handlers = served
    answer = await call_kind(channel, kind, TEST_CREDENTIAL)
    assert answer in (b"done:x", b"ab", b"onetwo")
    assert handlers.reached == [kind]


async def test_other_methods_need_no_credential(
    served: tuple[grpc.aio.Channel, Handlers],
) -> None:
    channel, handlers = served
    assert await channel.unary_unary(NOT_CONTROL)(b"y", timeout=10) == b"done:y"
    assert handlers.reached == ["unary"]


async def test_a_server_without_a_credential_refuses_every_control_call() -> None:
    handlers = Handlers()
    server = ServiceServer("control", port=0, drain_grace_s=0.5)
    server.add_service(handlers.register, None, "control")
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call_kind(channel, "unary", TEST_CREDENTIAL)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await server.drain()
    assert handlers.reached == []


def test_the_control_methods_are_the_writes_of_every_service() -> None:
    assert UNARY in CONTROL_METHODS and CLIENT_STREAMING in CONTROL_METHODS
    assert SERVER_STREAMING in CONTROL_METHODS and NOT_CONTROL not in CONTROL_METHODS


def test_the_token_file_is_owner_only_and_kept_across_restarts(tmp_path: Path) -> None:
    assert read_control_token(tmp_path) is None
    with pytest.raises(ControlCredentialMissing, match="servemesh up"):
        control_metadata_for(tmp_path)
    token = ensure_control_token(tmp_path)
    path = control_token_path(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(token) >= 32
    assert ensure_control_token(tmp_path) == token  # the same state dir keeps its token
    assert read_control_token(tmp_path) == token
    assert control_metadata_for(tmp_path) == (("authorization", f"Bearer {token}"),)
    assert ensure_control_token(tmp_path / "other") != token
