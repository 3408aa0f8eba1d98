"""The control credential in tests: a token for in-process servers, and channels that send it.

Tests that exercise control calls as a side matter (uploads, loads, feature writes) talk
through a channel that adds the credential to every call, as the mesh's own callers do;
the tests of the credential itself use bare channels and explicit metadata.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from servemesh.contract.control_credential import Metadata, control_metadata, control_token_path
from servemesh.identity import Dial
from servemesh.services.runtime import ServiceServer

# The token of in-process test servers (a mesh of processes makes its own, at random).
TEST_TOKEN = "test-control-token-0123456789abcdef"
TEST_CREDENTIAL: Metadata = control_metadata(TEST_TOKEN)


def _with_credential(details: Any, credential: Metadata) -> Any:
    metadata = [*(details.metadata or ()), *credential]
    return grpc.aio.ClientCallDetails(
        method=details.method,
        timeout=details.timeout,
        metadata=grpc.aio.Metadata(*metadata),
        credentials=details.credentials,
        wait_for_ready=details.wait_for_ready,
    )


# grpc.aio files an interceptor under the first of the four kinds it is: one class per kind.
class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, credential: Metadata) -> None:
        self.credential = credential

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_credential(details, self.credential), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, credential: Metadata) -> None:
        self.credential = credential

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_credential(details, self.credential), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, credential: Metadata) -> None:
        self.credential = credential

    async def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_credential(details, self.credential), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, credential: Metadata) -> None:
        self.credential = credential

    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_credential(details, self.credential), request_iterator)


def credentialed_channel(
    target: str | Dial,
    credential: Metadata = TEST_CREDENTIAL,
    options: Sequence[tuple[str, Any]] | None = None,
) -> grpc.aio.Channel:
    """An aio channel to `target` (an address: plaintext) whose every call carries
    `credential`."""
    dial = Dial(target, None) if isinstance(target, str) else target
    return dial.aio_channel(
        options=options or (),
        interceptors=[
            _UnaryUnary(credential),
            _UnaryStream(credential),
            _StreamUnary(credential),
            _StreamStream(credential),
        ],
    )


def accept_test_credential(server: ServiceServer) -> None:
    """Make an in-process server (built from a spec whose state dir holds no token of the
    test's) check the test token."""
    server.control.token = TEST_TOKEN


def install_test_token(state_dir: Path) -> Path:
    """Leave TEST_TOKEN in `state_dir` as `servemesh up` leaves its own (owner-only), so
    commands run against a state dir of in-process servers send what those servers check."""
    path = control_token_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(TEST_TOKEN + "\n")
    return path
