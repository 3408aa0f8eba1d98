"""Which instances a fault acts on: a service in a zone (or every zone), or named replicas."""

from __future__ import annotations

from servemesh.chaos.errors import DrillError
from servemesh.spec import Instance, MeshSpec


def select(
    spec: MeshSpec,
    service: str = "model",
    zone: str | None = None,
    replicas: list[str] | str | None = None,
) -> list[Instance]:
    """Instances of `service` in `zone` (all zones when None), or the named replicas."""
    if isinstance(replicas, str):
        replicas = [replicas]
    instances = spec.instances()
    if replicas:
        known = {i.name for i in instances}
        unknown = sorted(set(replicas) - known)
        if unknown:
            raise DrillError(f"no replicas named {unknown}; known: {sorted(known)}")
        return [i for i in instances if i.name in replicas]
    if zone is not None and zone not in spec.zones:
        raise DrillError(f"no zone {zone!r}; zones: {spec.zones}")
    chosen = [i for i in instances if i.service == service and (zone is None or i.zone == zone)]
    if not chosen:
        why = ""
        if spec.profile == "small-host" and zone is not None:
            why = (
                f" (profile small-host: the {service} processes in {spec.zones[0]} serve every "
                "zone; a drill on one zone's own needs the default profile)"
            )
        raise DrillError(f"no {service} replicas in {zone or 'any zone'}{why}")
    return chosen


def describe(service: str, zone: str | None, replicas: list[str] | str | None) -> str:
    """The scope as a fault window's label and key read it: `model zone-a`,
    `model-fraud-zone-a-0`."""
    if replicas:
        return ", ".join([replicas] if isinstance(replicas, str) else replicas)
    return f"{service} {zone or 'all zones'}"
