"""What the scaler decides for one zone's pool: pure functions of the policy, the signals and
an injected clock, so every rule is tested without a mesh and without waiting.

1. **Recommendation** (`recommend`): from the signals alone. Each signal with a target gives
   a ratio (value / target); the worst one sets the pool's size in proportion, as
   Kubernetes' HPA does: twice the target asks for twice the replicas (at most `step_up`
   more). A pool whose every ratio is under `down_below` may shrink by `step_down`, and
   only to a size at which the worst ratio stays under 1 - TOLERANCE. In between it holds
   (hysteresis). An error ratio above its target asks for one step more.
2. **Windows** (`Stabilizer`): a scale-up happens only when every recommendation of the
   last `up_window` asked for more (the smallest of them is taken); a scale-in only when
   every recommendation of the last `down_window` allowed it (the largest of them). No
   decision at all for `cooldown` after a change of the zone's pool took effect.
3. **Floors and bounds** (`decide`): the floor is `min`, raised by the schedule's floor of
   the moment; the ceiling is `max`. Below the floor the pool grows to it at once, above
   the ceiling it shrinks to it at once, whatever the windows say.
4. **The caller's side** (`demand`): when the edge's p99 or failed share breached the
   objective over the up-window (the loop's `EdgeWatch`) and this pool is the one blamed
   (`blame.py`), the pool grows by a step even though its own signals are at target.
5. **No headroom** (`saturated`): on a host whose cores are all busy with a run queue
   longer than them (`host.py`), no signal grows a pool: the decision says so instead.
6. **Kept for the caller** (`keep`): no pool of a zone shrinks while the zone's edge p99 is
   above `down_below` of its objective, so a pool grown for the edge is not taken back by
   its own low signals a minute later (and grown again).

Every decision carries the reason a person reads in `servemesh scale history`, e.g.
"p99_ms 182 > 100 over 10s: zone-a 1 -> 2".
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime

from servemesh.scaling.schedule import floor_at
from servemesh.spec.scaling_policy import PoolPolicy

# A ratio within this much of 1 is "at target": neither up nor down (no flapping on noise).
TOLERANCE = 0.1


@dataclass(frozen=True)
class PoolSignals:
    """What one zone's pool measured over the last interval (None: not measured, e.g. no
    calls for a p99)."""

    replicas: int  # in rotation
    p99_ms: float | None = None
    queue_depth: float | None = None
    cpu: float | None = None
    in_flight: float | None = None
    error_ratio: float | None = None
    calls_per_s: float = 0.0

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "replicas": self.replicas,
            "p99_ms": _rounded(self.p99_ms),
            "queue_depth": _rounded(self.queue_depth),
            "cpu": _rounded(self.cpu),
            "in_flight": _rounded(self.in_flight),
            "error_ratio": _rounded(self.error_ratio, 4),
            "calls_per_s": _rounded(self.calls_per_s),
        }


def _rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    why: str  # the signal that set it, e.g. "p99_ms 182 > 100"


def ratios(policy: PoolPolicy, signals: PoolSignals) -> dict[str, tuple[float, float]]:
    """Each measured signal that has a target: (value, target)."""
    target = policy.target
    found: dict[str, tuple[float, float]] = {}
    for name, value, goal in (
        ("p99_ms", signals.p99_ms, target.p99_ms),
        ("queue_depth", signals.queue_depth, target.queue_depth),
        ("cpu", signals.cpu, target.cpu),
        ("in_flight", signals.in_flight, target.in_flight),
    ):
        if value is not None and goal is not None:
            found[name] = (value, goal)
    return found


def _shown(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2f}"


def recommend(policy: PoolPolicy, signals: PoolSignals) -> Recommendation:
    """The replicas the signals ask for now (before windows, floors and bounds)."""
    n = signals.replicas
    measured = ratios(policy, signals)
    worst_name, (worst_value, worst_goal) = max(
        measured.items(), key=lambda kv: kv[1][0] / kv[1][1], default=("", (0.0, 1.0))
    )
    worst = worst_value / worst_goal
    if n < 1:
        return Recommendation(1, "no replica in rotation")
    if worst > 1 + TOLERANCE:
        want = min(n + policy.step_up, max(n + 1, math.ceil(n * worst)))
        return Recommendation(want, f"{worst_name} {_shown(worst_value)} > {_shown(worst_goal)}")
    errors, goal = signals.error_ratio, policy.target.error_ratio
    if errors is not None and goal is not None and errors > goal:
        return Recommendation(n + 1, f"error_ratio {errors:.2%} > {goal:.2%}")
    if worst < policy.down_below and n > 1:
        # The smallest size at which the worst signal stays under target, a step at a time.
        fits = math.ceil(n * worst / (1 - TOLERANCE)) if worst else 1
        want = max(n - policy.step_down, fits, 1)
        if want < n:
            why = f"every signal under {policy.down_below:.0%} of its target" + (
                f" ({worst_name} {_shown(worst_value)})" if worst_name else " (idle)"
            )
            return Recommendation(want, why)
    return Recommendation(n, "at target")


@dataclass
class Stabilizer:
    """One zone's recent recommendations, and when its pool last changed."""

    seen: deque[tuple[float, Recommendation]] = field(default_factory=deque)
    last_change_at: float | None = None

    def note(self, at: float, recommendation: Recommendation, keep_s: float) -> None:
        self.seen.append((at, recommendation))
        # Keep one older than the longest window: it proves the window is covered.
        while len(self.seen) > 1 and self.seen[1][0] <= at - keep_s:
            self.seen.popleft()

    def covered(self, at: float, window_s: float) -> list[Recommendation] | None:
        """The recommendations of the last `window_s`, when they cover it all."""
        if not self.seen or self.seen[0][0] > at - window_s:
            return None
        return [r for t, r in self.seen if t >= at - window_s] or [self.seen[-1][1]]

    def changed(self, at: float) -> None:
        """The pool changed: the windows start again (what they held was about its old size)."""
        self.last_change_at = at
        self.seen.clear()


@dataclass(frozen=True)
class Decision:
    zone: str
    current: int
    desired: int
    reason: str
    signals: PoolSignals
    floor: int
    held: str = ""  # why no change although the signals asked for one ("" otherwise)
    pool: str = "model"  # what is scaled: a model pool (model-fraud), gateway or feature
    # What moved it (or asked to): the pool's own signals ("replicas"), the caller's side
    # ("edge"), or a floor or bound ("bounds").
    signal: str = "replicas"

    @property
    def changes(self) -> bool:
        return self.desired != self.current

    def line(self) -> str:
        """What `servemesh scale history` prints for it."""
        pool = self.pool
        if self.changes:
            return f"{self.reason}: {pool} {self.zone} {self.current} -> {self.desired}"
        return f"{self.reason}: {pool} {self.zone} stays {self.current}" + (
            f" ({self.held})" if self.held else ""
        )


def decide(
    zone: str,
    policy: PoolPolicy,
    signals: PoolSignals,
    stabilizer: Stabilizer,
    at: float,
    now: datetime,
    predicted: tuple[int, str] | None = None,
    demand: tuple[int, str] | None = None,
    saturated: str | None = None,
    keep: str | None = None,
) -> Decision:
    """One round for one zone: `at` on the scaler's monotonic clock, `now` the wall time
    (the schedule's floors are local times); `predicted`: the forecast's floor and why
    (servemesh/scaling/forecast.py), when the policy forecasts. The decision is of the
    model servers' pool unless the caller names another (`dataclasses.replace(d, pool=)`).
    `demand`: the replicas the edge's breach asks of this pool, and why; `saturated`: the
    host's load in words when it has no headroom (no scale-up then); `keep`: why the pool
    may not shrink now whatever its own signals say (the zone's edge above `down_below` of
    its objective)."""
    n = signals.replicas
    recommendation = recommend(policy, signals)
    stabilizer.note(at, recommendation, max(policy.up_window_s, policy.down_window_s))
    scheduled, entry = floor_at(policy.schedule, now)
    floors = [(policy.min, f"min {policy.min}")]
    if entry is not None:
        hours = f"{entry.start}-{entry.end} {policy.schedule.timezone}"
        floors.append((scheduled, f"schedule floor {scheduled} ({hours})"))
    if predicted is not None:
        floors.append((min(predicted[0], policy.max), predicted[1]))
    floor, why = max(floors, key=lambda f: f[0])
    if n < floor:
        return Decision(zone, n, floor, why, signals, floor, signal="bounds")
    if n > policy.max:
        return Decision(zone, n, policy.max, f"max {policy.max}", signals, floor, signal="bounds")
    cooling = stabilizer.last_change_at is not None and (
        at - stabilizer.last_change_at < policy.cooldown_s
    )
    want = recommendation.replicas
    if saturated is not None and (want > n or (demand is not None and demand[0] > n)):
        asked = recommendation if want > n else Recommendation(n, demand[1] if demand else "")
        signal = "replicas" if want > n else "edge"
        held = f"no headroom on this host: {saturated}"
        return replace(_hold(zone, n, asked, signals, floor, held), signal=signal)
    if want <= n and demand is not None and demand[0] > n:
        if cooling:
            hold = _hold(zone, n, Recommendation(n, demand[1]), signals, floor, "cooldown")
            return replace(hold, signal="edge")
        desired = min(demand[0], policy.max)
        if desired <= n:
            held = f"at max {policy.max}"
            hold = _hold(zone, n, Recommendation(n, demand[1]), signals, floor, held)
            return replace(hold, signal="edge")
        return Decision(zone, n, desired, demand[1], signals, floor, signal="edge")
    if want > n:
        window = stabilizer.covered(at, policy.up_window_s)
        if cooling:
            return _hold(zone, n, recommendation, signals, floor, "cooldown")
        if window is None or min(r.replicas for r in window) <= n:
            return _hold(zone, n, recommendation, signals, floor, f"not yet {policy.up_window}")
        desired = min(min(r.replicas for r in window), policy.max)
        if desired <= n:
            return _hold(zone, n, recommendation, signals, floor, f"at max {policy.max}")
        why = f"{recommendation.why} over {policy.up_window}"
        return Decision(zone, n, desired, why, signals, floor)
    if want < n:
        window = stabilizer.covered(at, policy.down_window_s)
        if cooling:
            return _hold(zone, n, recommendation, signals, floor, "cooldown")
        if keep is not None:
            # The pool may have grown for the caller's side: its own signals being low
            # says nothing about the edge, which would only ask for it again.
            return _hold(zone, n, recommendation, signals, floor, keep)
        if window is None or max(r.replicas for r in window) >= n:
            return _hold(zone, n, recommendation, signals, floor, f"not yet {policy.down_window}")
        desired = max(max(r.replicas for r in window), floor)
        if desired >= n:
            return _hold(zone, n, recommendation, signals, floor, f"at floor {floor}")
        why = f"{recommendation.why} over {policy.down_window}"
        return Decision(zone, n, desired, why, signals, floor)
    return Decision(zone, n, n, recommendation.why, signals, floor)


def _hold(
    zone: str,
    n: int,
    recommendation: Recommendation,
    signals: PoolSignals,
    floor: int,
    held: str,
) -> Decision:
    return Decision(zone, n, n, recommendation.why, signals, floor, held=held)
