"""The one error tree of servemesh: each class carries the gRPC status its caller sees.

    MeshError                      INTERNAL (the base; any code may be given explicitly)
    ├── InvalidArgument            INVALID_ARGUMENT  the message starts with the field's name
    ├── NotFound                   NOT_FOUND
    ├── AlreadyExists              ALREADY_EXISTS
    ├── ResourceExhausted          RESOURCE_EXHAUSTED  shed load, a size or quota exceeded
    ├── DeadlineExceeded           DEADLINE_EXCEEDED   the caller's time is up
    ├── Unavailable                UNAVAILABLE         closing, draining, a dependency down
    ├── FailedPrecondition         FAILED_PRECONDITION a call out of order
    ├── DataLoss                   DATA_LOSS           stored bytes are gone or corrupt
    └── Internal                   INTERNAL            a bug or a model that raised

Services raise these (or their own subclasses, which only add a name) from anywhere in a
call; every `ServiceServer`'s call path (`answer_failure`) turns them into the status and
message the caller gets, so no servicer maps errors by hand. Anything else a handler
raises reaches the caller as INTERNAL "internal error", with the traceback in the log and
never on the wire.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from servemesh.contract.errors import ServemeshError

log = logging.getLogger(__name__)

# Statuses that say the caller asked for something wrong; logged at info, not as failures.
_CALLER_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


class MeshError(ServemeshError):
    """A refusal or failure of one call, with the status code and message its caller gets.

    Messages are short and safe to send: never a traceback, a secret or model internals.
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    # True for refusals whose raiser already logged them with more detail (the batcher's
    # sheds and deadline drops): the call path then does not log them again, which under
    # overload would double the log lines exactly when they cost the most.
    logged_at_source: bool = False

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(MeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(MeshError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(MeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(MeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(MeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(MeshError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(MeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(MeshError):
    code = grpc.StatusCode.DATA_LOSS


class Internal(MeshError):
    code = grpc.StatusCode.INTERNAL


def is_caller_error(code: grpc.StatusCode) -> bool:
    """True for statuses that describe the request rather than a fault of the service."""
    return code in _CALLER_CODES


# The longest status message sent. A message can echo what the caller sent (a name of
# 70,000 characters): as the grpc-message trailer that exceeds Envoy's header limit, and
# Envoy answers the caller with a reset instead of the status.
MAX_WIRE_MESSAGE_CHARS = 1024


def wire_message(message: str) -> str:
    """The message as sent: cut to MAX_WIRE_MESSAGE_CHARS, marked where it was cut."""
    if len(message) <= MAX_WIRE_MESSAGE_CHARS:
        return message
    return message[: MAX_WIRE_MESSAGE_CHARS - 20] + f"... ({len(message)} chars)"


async def abort_with(context: grpc.aio.ServicerContext, error: MeshError) -> NoReturn:
    """End the call with the error's status and message (bounded in length)."""
    await context.abort(error.code, wire_message(error.message))
    raise AssertionError("unreachable: context.abort raises")


async def answer_failure(
    exc: Exception, context: grpc.aio.ServicerContext, method: str
) -> NoReturn:
    """End the call with what `exc` says: a MeshError's status and message, or INTERNAL
    "internal error" for anything else (its traceback goes to the log, never the wire)."""
    if isinstance(exc, MeshError):
        if not exc.logged_at_source:
            level = logging.INFO if is_caller_error(exc.code) else logging.WARNING
            log.log(
                level,
                "call refused",
                extra={"method": method, "code": exc.code.name, "reason": exc.message},
            )
        await abort_with(context, exc)
    log.error("call failed", exc_info=exc, extra={"method": method})
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")
    raise AssertionError("unreachable: context.abort raises")
