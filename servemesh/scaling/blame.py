"""Which pool a breach at the edge is scaled on: pure functions of the signals, tested
without a mesh.

A Predict crosses three hops: the gateway (and whatever waits in front of it and in its
event loop), the feature service and a model server. Each pool's own p99 says how long
its hop took; the edge's p99 says what the caller paid in all. Their shares of the edge's
p99 (`hop_shares`):

- a model pool's: its ModelInfer p99 / the edge's;
- the feature pool's: its GetFeatures p99 / the edge's;
- the gateway pool's: what neither explains, (edge - slowest model - feature) / edge. This
  is the time inside the gateways and queued before and between processes: under
  overload, most of it.

p99s do not add up exactly, so the shares are a guide, not an account. The pool chosen
(`blame`) is the one whose share grew most since the edge last met its objective, when it
grew clearly more than any other (`CLEAR_GROWTH`); when none can be told apart (no such
baseline yet, or shares that moved together), the gateway pool first, then the slowest
model pool, then the feature pool, each only while it is below its max.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# A share must grow by this much more than every other's to be told apart.
CLEAR_GROWTH = 0.1


@dataclass(frozen=True)
class Hop:
    label: str  # scaled_pool_label: gateway, feature, model-<pool>
    kind: str  # gateway, feature, model
    p99_ms: float | None  # the pool's own p99 in the zone this interval (None: no calls)
    room: bool  # below its max: growing it is possible


def hop_shares(edge_p99_ms: float, hops: Mapping[str, Hop]) -> dict[str, float]:
    """Each pool's share of the edge's p99 (see the module's text)."""
    if edge_p99_ms <= 0:
        return {}
    models = [h.p99_ms or 0.0 for h in hops.values() if h.kind == "model"]
    feature = next((h.p99_ms or 0.0 for h in hops.values() if h.kind == "feature"), 0.0)
    slowest_model = max(models, default=0.0)
    shares: dict[str, float] = {}
    for label, hop in hops.items():
        if hop.kind == "gateway":
            rest = edge_p99_ms - slowest_model - feature
            shares[label] = max(rest, 0.0) / edge_p99_ms
        else:
            shares[label] = min((hop.p99_ms or 0.0) / edge_p99_ms, 1.0)
    return shares


@dataclass(frozen=True)
class Blame:
    label: str
    why: str  # e.g. "gateway's share of the edge p99 0.82 (was 0.31)"


def blame(
    shares: Mapping[str, float],
    baseline: Mapping[str, float] | None,
    hops: Mapping[str, Hop],
) -> Blame | None:
    """The pool to grow, and why; None when no pool has room."""
    candidates = {label: hop for label, hop in hops.items() if hop.room}
    if not candidates:
        return None
    if baseline:
        growth = {label: shares.get(label, 0.0) - baseline.get(label, 0.0) for label in candidates}
        ranked = sorted(growth.items(), key=lambda kv: kv[1], reverse=True)
        top, grew = ranked[0]
        runner_up = ranked[1][1] if len(ranked) > 1 else 0.0
        if grew > 0 and grew - max(runner_up, 0.0) >= CLEAR_GROWTH:
            return Blame(
                top,
                f"{top}'s share of the edge p99 {shares.get(top, 0.0):.2f} "
                f"(was {baseline.get(top, 0.0):.2f})",
            )
    order = sorted(
        candidates.values(),
        key=lambda h: ({"gateway": 0, "model": 1, "feature": 2}[h.kind], -(h.p99_ms or 0.0)),
    )
    first = order[0]
    told = "no baseline within the objective yet" if not baseline else "no share grew clearly"
    return Blame(first.label, f"{told}: {first.kind} first")
