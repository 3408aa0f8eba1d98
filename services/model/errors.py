"""The model server's errors: names for its refusals, placed in the runtime's error tree.

Each class only names a situation; the status code comes from the tree class it extends,
and the runtime's ErrorStatusInterceptor answers the caller with it.
"""

from __future__ import annotations

from servemesh.services.runtime.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

# Any failure of one request (kept as the name the model server's code catches).
ServingError = MeshError

__all__ = [
    "DeadlineMissed",
    "InferenceFailed",
    "LoadError",
    "ModelNotFound",
    "NotInSpec",
    "Overloaded",
    "QueueFull",
    "RequestError",
    "ServingError",
    "Unavailable",
]


class RequestError(InvalidArgument):
    """The request itself is malformed; the message names the offending field."""


class ModelNotFound(NotFound):
    """The request names a model or version this replica does not host."""


class QueueFull(ResourceExhausted):
    """The batcher's queue is at its bound; the request is shed without waiting."""

    logged_at_source = True  # the batcher logs each shed request


class Overloaded(ResourceExhausted):
    """The replica already holds as many ModelInfer calls as it admits; refused at the door,
    before the request is read (admission control, see `servicer`)."""

    # Refusals come in floods under overload: a log line each would cost more than the
    # refusal. The RPC metrics count them by status.
    logged_at_source = True


class DeadlineMissed(DeadlineExceeded):
    """The request's deadline passed, or cannot be met, before the model ran it."""

    logged_at_source = True  # the batcher logs each dropped request


class InferenceFailed(Internal):
    """The model raised on this request (isolated from the rest of its batch)."""


class LoadError(FailedPrecondition):
    """A model version could not be loaded; the message says which and why."""


class NotInSpec(FailedPrecondition):
    """A load asked for a version the replica's spec does not name (and no apply's spec
    entry came with it): what a replica serves changes through `servemesh apply`."""
