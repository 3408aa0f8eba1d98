"""Errors the model server answers with: each carries the gRPC status the caller sees."""

from __future__ import annotations

import grpc


class ServingError(Exception):
    """A failure of one request, with the status code and message its caller gets.

    Messages are short and safe to send: they never carry a traceback or model internals.
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class RequestError(ServingError):
    """The request itself is malformed; the message names the offending field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(ServingError):
    """The request names a model or version this replica does not host."""

    code = grpc.StatusCode.NOT_FOUND


class QueueFull(ServingError):
    """The batcher's queue is at its bound; the request is shed without waiting."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineMissed(ServingError):
    """The request's deadline passed, or cannot be met, before the model ran it."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InferenceFailed(ServingError):
    """The model raised on this request (isolated from the rest of its batch)."""

    code = grpc.StatusCode.INTERNAL


class Unavailable(ServingError):
    """The model is closing (drain or unload) and takes no new requests."""

    code = grpc.StatusCode.UNAVAILABLE
