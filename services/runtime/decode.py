"""Request bodies are decoded inside the call, so a body that is no message of the
method's type is INVALID_ARGUMENT naming the type, like any other bad input.

Left to grpc.aio, a protobuf DecodeError in the request deserializer answers UNKNOWN
"Unexpected <class 'google.protobuf.message.DecodeError'>: ..." (an internal class name
on the wire), and one in a client stream's iterator surfaces in the handler as a bug
(INTERNAL). So the server's call path registers each method with identity
deserialization and decodes each body itself with `decoder`, whose InvalidArgument the
call path answers like any handler's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from servemesh.services.runtime.errors import InvalidArgument

Decode = Callable[[bytes], Any]


def decoder(deserializer: Decode) -> Decode:
    """`deserializer`, raising InvalidArgument naming the message type when it fails."""

    def decode(body: bytes) -> Any:
        try:
            return deserializer(body)
        except Exception:  # DecodeError, or a deserializer's own refusal
            name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
            what = f"a {name.full_name} message" if name is not None else "a valid message"
            raise InvalidArgument(f"request: not {what}") from None

    return decode


async def decoded(requests: AsyncIterator[bytes], decode: Decode) -> AsyncIterator[Any]:
    """A client stream's messages, each decoded as it arrives."""
    async for body in requests:
        yield decode(body)
