"""Why the registry refused something; each message names the field or the object concerned.

The store raises these; each extends a class of the runtime's error tree, which gives the
gRPC status the caller sees.
"""

from __future__ import annotations

from servemesh.services.runtime.errors import (
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)

# Any refusal of the registry's (the store and the servicer catch this name).
RegistryError = MeshError


class InvalidArgumentError(InvalidArgument):
    """A request field is malformed; the message starts with the field's name."""


class DigestMismatchError(InvalidArgumentError):
    """The uploaded bytes do not match the declared size or sha256."""


class NotFoundError(NotFound):
    """A model, version or alias does not exist."""


class PermissionDeniedError(PermissionDenied):
    """The caller may not have what it asked for (a model server, another pool's model)."""


class AlreadyExistsError(AlreadyExists):
    """The name is taken: versions are immutable, models are created once."""


def version_taken(model: str, version: str, sha256: str) -> str:
    """Why an upload of other bytes under an existing version name is refused, in the words
    the store and the client's check before streaming both use."""
    return f"version {model}/{version} already exists with sha256 {sha256}; versions are immutable"


class ArtifactTooLargeError(ResourceExhausted):
    """An artifact exceeds a size limit (the registry's, or the caller's)."""


class QuotaExceededError(ResourceExhausted):
    """Storing an artifact would pass the registry's quota on stored bytes."""


class UploadIdleError(DeadlineExceeded):
    """An upload stream sent nothing for longer than the registry waits."""


class UploadProtocolError(FailedPrecondition):
    """The upload stream is out of order: no header first, or a second header."""


class BlobMissingError(DataLoss):
    """A version's record exists but its artifact is gone from disk."""
