"""The drills' background load: Predict through the edge, one entity per call, at a fixed
rate from the drill's start to its end (servemesh.load's open loop, in a thread).

Probes and the guard read its windows while it runs; its time zero is the drill's.
"""

from __future__ import annotations

from collections.abc import Sequence

from servemesh.identity import Dial
from servemesh.load import BackgroundLoad, predict_target


def drill_load(
    edge: Dial,
    *,
    rate_per_s: float,
    model: str = "fraud",
    entities: int = 100,
    timeout_s: float = 2.0,
    metadata: Sequence[tuple[str, str]] = (),
) -> BackgroundLoad:
    """The load a drill runs against its mesh's edge (where `edge` leads), with each call's deadline
    `timeout_s`; on stop, calls in flight get their deadline and 5 s more to answer."""
    target = predict_target(
        edge, model=model, entities=entities, timeout_s=timeout_s, metadata=metadata
    )
    return BackgroundLoad(target, rate_per_s=rate_per_s, drain_s=timeout_s + 5)
