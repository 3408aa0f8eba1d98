"""Why the registry refused something; each message names the field or the object concerned.

The store raises these; the gRPC servicer maps each class to one status code.
"""

from __future__ import annotations


class RegistryError(Exception):
    """A refusal the caller can act on."""


class InvalidArgumentError(RegistryError):
    """A request field is malformed; the message starts with the field's name."""


class DigestMismatchError(InvalidArgumentError):
    """The uploaded bytes do not match the declared size or sha256."""


class NotFoundError(RegistryError):
    """A model, version or alias does not exist."""


class AlreadyExistsError(RegistryError):
    """The name is taken: versions are immutable, models are created once."""


class ArtifactTooLargeError(RegistryError):
    """An artifact exceeds a size limit (the registry's, or the caller's)."""


class UploadProtocolError(RegistryError):
    """The upload stream is out of order: no header first, or a second header."""


class BlobMissingError(RegistryError):
    """A version's record exists but its artifact is gone from disk."""
