"""What every section of the mesh spec shares: its error, the strict model each section is
built on, and the names, ports and service kinds the sections type their fields with."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from servemesh.contract.errors import ServemeshError
from servemesh.spec.policy import StrictModel

ZoneName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,30}$")]
Name = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]
Port = Annotated[int, Field(ge=0, le=65535)]
ServiceKind = Literal["registry", "model", "feature", "gateway"]
# The kinds whose replicas per zone the scaler sets (servemesh.scaling): every kind but the
# registry. The model servers' count lives in FleetState.per_zone (it predates the others).
ScaledKind = Literal["model", "feature", "gateway"]
SCALED_KINDS: tuple[ScaledKind, ...] = ("model", "gateway", "feature")
# The kinds besides the model servers, whose live counts are FleetState.pools.
FrontKind = Literal["feature", "gateway"]


class SpecError(ServemeshError, ValueError):
    """The mesh spec is malformed; the message names the file and the field."""


_Strict = StrictModel
