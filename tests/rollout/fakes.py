"""A pretend mesh for the controller's state machine: a clock that moves only when the
controller sleeps, routes that remember every change, and arms whose counters grow with
the traffic the routes give them. No network, no processes: each test runs in
milliseconds and says exactly when the controller acted."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from servemesh.rollout.controller import Controller, Parts
from servemesh.rollout.types import ArmWindow, Check, ChecklistItem, Verdict
from servemesh.spec.rollout_plan import AnalysisSpec, RolloutPlan, RolloutStep
from servemesh.state.paths import ApplyError
from servemesh.state.rollouts import StateStore


class Crash(BaseException):
    """The controller's process dies here (as a SIGKILL would: no Exception handler runs)."""


@dataclass
class Arm:
    """How a version behaves: the share of its calls that fail, and its p99."""

    error_ratio: float = 0.0
    p99_ms: float = 10.0


@dataclass
class World:
    rate_per_s: float = 100.0
    arms: dict[str, Arm] = field(default_factory=lambda: {"v1": Arm(), "v2": Arm()})
    weights: dict[str, int] = field(default_factory=lambda: {"v1": 100, "v2": 0})
    shadow: str | None = None
    psi_verdicts: list[Verdict] = field(default_factory=list)
    t: float = 1_000_000.0
    requests: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    changes: list[tuple[float, str, Any]] = field(default_factory=list)
    # Called after each sleep with the world: tests act "while the controller waits".
    on_sleep: list[Callable[[World], None]] = field(default_factory=list)
    busy_changes: int = 0  # the next N route changes find the mesh's change lock taken
    crash_before: int | None = None  # the controller dies asking for this canary weight

    # --- the clock ---------------------------------------------------------------------

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        for version, weight in self.weights.items():
            self._serve(version, self.rate_per_s * seconds * weight / 100)
        if self.shadow is not None:
            self._serve(self.shadow, self.rate_per_s * seconds)
        self.t += seconds
        for hook in list(self.on_sleep):
            hook(self)

    def _serve(self, version: str, calls: float) -> None:
        self.requests[version] = self.requests.get(version, 0.0) + calls
        self.errors[version] = (
            self.errors.get(version, 0.0) + calls * self.arms[version].error_ratio
        )

    # --- routes (RouteManager's surface) -------------------------------------------------

    def live_spec(self) -> Any:
        model = SimpleNamespace(
            traffic=dict(self.weights),
            shadow=None if self.shadow is None else {"version": self.shadow},
            versions=dict.fromkeys(self.arms, object()),
        )
        return SimpleNamespace(models={"fraud": model}, rollout=SimpleNamespace(slos={}))

    def _busy(self) -> None:
        if self.busy_changes:
            self.busy_changes -= 1
            raise ApplyError(
                "another change to this mesh is under way (pid 1); run this one when it "
                "has finished"
            )

    def set_weights(self, model: str, weights: dict[str, int], *, who: str | None = None) -> None:
        if self.crash_before is not None and weights.get("v2") == self.crash_before:
            raise Crash()
        self._busy()
        self.weights = {v: weights.get(v, 0) for v in self.arms}
        self.changes.append((self.t, "weights", dict(self.weights)))

    def set_shadow(
        self, model: str, version: str | None, percent: float = 100.0, *, who: str | None = None
    ) -> None:
        self._busy()
        self.shadow = version
        self.changes.append((self.t, "shadow", version))

    # --- the arm source and the analysis ---------------------------------------------------

    def snapshot(self, model: str, *, shadow: bool) -> dict[str, tuple[float, float]]:
        return {v: (self.requests.get(v, 0.0), self.errors.get(v, 0.0)) for v in self.arms}

    def window(self, before: Any, after: Any) -> dict[str, ArmWindow]:
        return {
            v: ArmWindow(
                version=v,
                requests=int(after[v][0] - before[v][0] + 1e-6),
                errors=int(after[v][1] - before[v][1] + 1e-6),
            )
            for v in after
        }

    def judge(self, base: ArmWindow, canary: ArmWindow, analysis: AnalysisSpec) -> list[Check]:
        if min(base.requests, canary.requests) < analysis.min_samples:
            return [Check("samples", "wait", f"{canary.requests} canary calls")]
        # A scripted PSI verdict per judgement, where a test gives some (none: no PSI check).
        psi = [Check("psi", v, f"PSI scripted {v}") for v in self.psi_verdicts[:1]]
        del self.psi_verdicts[:1]
        increase = (canary.error_ratio - base.error_ratio) * 100
        limit = analysis.max_error_ratio_increase_points
        p99 = self.arms[canary.version].p99_ms / self.arms[base.version].p99_ms
        return [
            Check(
                "error_ratio",
                "fail" if increase > limit else "pass",
                f"error ratio {canary.error_ratio:.1%} vs baseline {base.error_ratio:.1%} "
                f"(+{increase:.1f} points, limit +{limit})",
            ),
            Check(
                "p99",
                "fail" if p99 > analysis.max_p99_ratio else "pass",
                f"p99 {p99:.2f}x the baseline's (limit {analysis.max_p99_ratio}x)",
            ),
            *psi,
        ]


@dataclass
class Gates:
    """Checklist items by name that fail (before traffic, and on shadow traffic)."""

    failing: set[str] = field(default_factory=set)
    shadow_failing: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)

    def preflight(
        self,
        spec: Any,
        model: str,
        version: str,
        plan: RolloutPlan,
        *,
        now: Any,
        overrides: Mapping[str, str],
    ) -> list[ChecklistItem]:
        self.calls.append("preflight")
        return [
            ChecklistItem(
                name,
                name not in self.failing,
                f"{name} {'failed' if name in self.failing else 'ok'}",
                overrides.get(name) if name in self.failing else None,
            )
            for name in ("artifact_sha256", "offline_metrics", "rollback_target", "freeze")
        ]

    def after_shadow(
        self,
        windows: Mapping[str, ArmWindow],
        baseline: str,
        canary: str,
        plan: RolloutPlan,
        slo: Any,
        *,
        overrides: Mapping[str, str],
    ) -> list[ChecklistItem]:
        self.calls.append(f"after_shadow {windows[canary].requests}")
        return [
            ChecklistItem(
                name,
                name not in self.shadow_failing,
                f"{name} {'failed' if name in self.shadow_failing else 'ok'}",
                overrides.get(name) if name in self.shadow_failing else None,
            )
            for name in ("shadow_latency", "distribution")
        ]

    def render(self, items: Sequence[ChecklistItem]) -> str:
        return "\n".join(f"{'ok' if i.ok else 'FAIL'} {i.name}: {i.detail}" for i in items)


def short_plan(*weights: int | None, dwell: str = "2s", min_requests: int = 20) -> RolloutPlan:
    steps = [RolloutStep(weight=w, dwell=dwell, min_requests=min_requests) for w in weights]
    return RolloutPlan(
        steps=steps,
        analysis=AnalysisSpec(interval="1s", min_samples=10),
        deadline="10m",
    )


def controller(
    tmp_path: Any, world: World, gates: Gates | None = None, lines: list[str] | None = None
) -> Controller:
    gates = gates or Gates()
    said = lines if lines is not None else []
    parts = Parts(
        routes=world,
        source=world,
        window=world.window,
        judge=world.judge,
        preflight=gates.preflight,
        after_shadow=gates.after_shadow,
        render_checklist=gates.render,
        clock=world.now,
        sleep=world.sleep,
    )
    return Controller(StateStore(tmp_path), parts, say=said.append)
