"""A steady Predict load through a running mesh's edge, for the tests that break one of its
Envoys (or its zones' network) under traffic and watch which zones keep answering."""

from __future__ import annotations

from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.load import BackgroundLoad, predict_target


def edge_load(mesh: Mesh, rate_per_s: float = 40.0) -> BackgroundLoad:
    """An open loop of Predicts for the demo's first 50 entities (5 s deadline each), not
    started yet."""
    target = predict_target(dial_edge(mesh.spec), entities=50, timeout_s=5.0)
    return BackgroundLoad(target, rate_per_s=rate_per_s)


def zones_answering(load: BackgroundLoad, since_s: float = 0.0) -> set[str]:
    """The zones whose gateways answered calls sent from `since_s` on."""
    return {o.zone for o in load.run.window(since_s) if o.ok}
