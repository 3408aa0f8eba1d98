"""What batch scoring refuses; every message names the field or flag it is about."""

from __future__ import annotations

from servemesh.contract.errors import ServemeshError


class BatchError(ServemeshError):
    """A batch run was refused or failed (exit 1); the message names why, in one line."""


class NothingToResume(BatchError):
    """`--resume` without a checkpoint of an interrupted run of the same job."""


class SourceChanged(BatchError):
    """The feature view a run reads was replaced under it (or since its checkpoint)."""
