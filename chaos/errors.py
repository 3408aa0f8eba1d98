"""The one error a drill's own code raises."""

from __future__ import annotations

from servemesh.contract.errors import ServemeshError


class DrillError(ServemeshError, RuntimeError):
    """A drill cannot do what was asked (no drill running, unknown replica...)."""
