"""The rollout controller: walks a plan's steps, judges each against the baseline, and
promotes or rolls back on its own.

The state machine knows no network: the route manager, the arm source, the analysis, the
checklist and the clock are handed to it (`Parts`), so tests drive it with fakes and an
injectable clock, and `servemesh rollout` hands it the real ones. Every change it makes is
recorded first in the durable state (`state.py`), then applied, so a controller killed at
any moment leaves a step that `resume` re-applies and continues from.

A step:

1. its routes: the shadow step mirrors every unpinned call to the canary (the baseline
   keeps answering), a weight step turns the shadow off and splits `{baseline: 100-w,
   canary: w}`;
2. a snapshot of both arms' counters when the step begins; then every `analysis.interval`
   another, and the canary is judged against the baseline over the window since the step
   began. A failed check rolls back at once (baseline 100, shadow off);
3. the step is done when `dwell` has passed, both arms answered `min_requests` and every
   check passes. At 100% the baseline answers nobody, so the canary is judged against the
   baseline's last full window of the step before.

Operators steer a running controller through the state file (pause, abort, promote), which
it reads every interval. While paused it keeps judging (a failing canary still rolls back)
but does not advance.
"""

from __future__ import annotations

import importlib
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from servemesh.contract.errors import ServemeshError
from servemesh.rollout.analysis import pinned_between
from servemesh.rollout.state import arm_of, check_record, checklist_record, window_record
from servemesh.rollout.types import ArmWindow, Check, ChecklistItem, Ending, Outcome
from servemesh.spec import ResolvedSpec
from servemesh.spec.rollout_plan import AnalysisSpec, RolloutPlan, RolloutStep, SloSpec, Strategy
from servemesh.state.paths import ApplyError
from servemesh.state.rollouts import Request, RolloutState, StateStore, who

# How long a route change waits for another change of the mesh (an operator's `routes set`,
# an apply) to finish before it gives up: the mesh takes one change at a time.
CHANGE_LOCK_WAIT_S = 30.0
_LOCK_BUSY = "another change to this mesh is under way"


class Routes(Protocol):
    """What the controller needs of `servemesh.proxy.apply.RouteManager`."""

    def live_spec(self) -> ResolvedSpec: ...

    def set_weights(
        self, model: str, weights: dict[str, int], *, who: str | None = None
    ) -> object: ...

    def set_shadow(
        self, model: str, version: str | None, percent: float = 100.0, *, who: str | None = None
    ) -> object: ...


class Source(Protocol):
    """An arm source (`analysis.ArmSource`): cumulative per-version counters of a model."""

    def snapshot(self, model: str, *, shadow: bool) -> Any: ...


Preflight = Callable[..., Sequence[ChecklistItem]]
AfterShadow = Callable[..., Sequence[ChecklistItem]]


@dataclass
class Parts:
    """The parts a controller drives. `cli.real_parts` builds the mesh's own."""

    routes: Routes
    source: Source
    # analysis.window(before, after) -> {version: ArmWindow}
    window: Callable[[Any, Any], Mapping[str, ArmWindow]]
    # analysis.judge(baseline, canary, analysis) -> [Check]
    judge: Callable[[ArmWindow, ArmWindow, AnalysisSpec], Sequence[Check]]
    # gates.preflight(spec, model, version, plan, *, now, overrides)
    preflight: Preflight
    # gates.after_shadow(windows, baseline, canary, plan, slo, *, overrides)
    after_shadow: AfterShadow
    # gates.render_checklist(items): printed before a rollout starts (or is refused)
    render_checklist: Callable[[Sequence[ChecklistItem]], Any]
    # The fleet strategies' module (StrategyContext, run_blue_green, run_rolling); None:
    # `servemesh.rollout.fleet`, imported when a fleet strategy is asked for.
    fleet: Any = None
    # The wall clock (epoch seconds: a deadline outlives the process) and how to wait.
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep


class ControllerError(ServemeshError, RuntimeError):
    """A rollout cannot be started or continued as asked (bad model, version, state)."""


def _empty(version: str) -> ArmWindow:
    return ArmWindow(version=version, requests=0, errors=0)


def describe_step(step: RolloutStep, model: str, version: str, baseline: str) -> str:
    if step.shadow:
        return f"{version} gets a copy of every {model} call; {baseline} answers"
    return f"{model} {baseline}={100 - (step.weight or 0)} {version}={step.weight}"


def check_line(check: Check) -> str:
    return f"{check.name} {check.verdict}: {check.detail}"


_FLEET_RUNNERS = {"blue-green": "run_blue_green", "rolling": "run_rolling"}


P99_CHECK = "p99"


def _settling(check: Check) -> Check:
    """The p99 check of a split step's first interval: it waits (see `_run_step`)."""
    return Check(check.name, "wait", f"(settling after the route change) {check.detail}")


# Checks whose fail is a statistical judgement: one rolls back only when the look after it
# fails as well. A step looks at its growing window once an interval, and each look may
# fail by chance (at the check's own significance): a good canary of a few dozen scores was
# seen failing PSI at p=0.0009 against a limit of 0.001. A real shift fails again one
# interval later, on more calls; a chance one rarely does.
CONFIRMED_CHECKS = frozenset({"psi"})


def _confirm(checks: list[Check], failed_last_look: set[str]) -> tuple[list[Check], set[str]]:
    """`checks` with the first fail of a confirmed check (one that did not fail at the last
    look) turned into a wait, and the confirmed checks that fail at this look."""
    failing = {c.name for c in checks if c.name in CONFIRMED_CHECKS and c.verdict == "fail"}
    unconfirmed = failing - failed_last_look
    confirmed = [
        Check(c.name, "wait", f"{c.detail}; to confirm at the next look")
        if c.name in unconfirmed
        else c
        for c in checks
    ]
    return confirmed, failing


def load_fleet() -> Any:
    """`servemesh.rollout.fleet` (StrategyContext, run_blue_green, run_rolling), imported
    when first used: a canary never pays for the fleet's imports."""
    return importlib.import_module("servemesh.rollout.fleet")


class Controller:
    """Starts, continues and ends rollouts of one mesh."""

    def __init__(
        self,
        store: StateStore,
        parts: Parts,
        *,
        say: Callable[[str], None] = print,
        show: Callable[[Any], None] | None = None,
    ) -> None:
        self.store = store
        self.parts = parts
        self.say = say
        # How a renderable (the checklist) is shown; plain text when nothing better is.
        self.show = show or (lambda renderable: say(str(renderable)))

    # --- the clock ------------------------------------------------------------------------

    def now(self) -> float:
        return self.parts.clock()

    # --- starting ---------------------------------------------------------------------------

    def start(
        self,
        model: str,
        version: str,
        plan: RolloutPlan,
        *,
        overrides: Mapping[str, str] | None = None,
    ) -> Ending:
        """Check, then run a rollout of `version` of `model` to its end (or refusal)."""
        overrides = dict(overrides or {})
        previous = self.store.load(model)
        if previous is not None and previous.active:
            previous = self.expire_if_due(model) or previous
        if previous is not None and previous.active:
            if self.store.alive(model):
                return self._refused(
                    f"a rollout of {model} ({previous.version}) is already under way; "
                    f"see `servemesh rollout status {model}`"
                )
            return self._refused(
                f"a rollout of {model} ({previous.version}, at step {previous.step_label}) "
                f"was left without a controller; continue it with `servemesh rollout resume "
                f"{model}` or end it with `servemesh rollout abort {model} --reason TEXT`"
            )
        live = self.parts.routes.live_spec()
        baseline = self._baseline(live, model, version)
        # Whatever cannot run fails here, before anything is recorded.
        if plan.strategy in _FLEET_RUNNERS and self.parts.fleet is None:
            self.parts.fleet = load_fleet()
        if plan.strategy == "shadow-only" and not plan.steps[0].shadow:
            raise ControllerError("--strategy shadow-only: the plan has no shadow step")
        with self.store.controlling(model) as mine:
            if not mine:
                return self._refused(f"another controller of {model} has just started")
            now = self.now()
            try:
                items = list(
                    self.parts.preflight(
                        live,
                        model,
                        version,
                        plan,
                        now=datetime.fromtimestamp(now, UTC),
                        overrides=overrides,
                    )
                )
            except ValueError as exc:  # an override of no item, or without a reason
                raise ControllerError(str(exc)) from None
            self._unknown_overrides(overrides, items)
            self.show(self.parts.render_checklist(items))
            state = RolloutState(
                id=uuid.uuid4().hex[:12],
                model=model,
                version=version,
                baseline=baseline,
                strategy=plan.strategy,
                plan=plan,
                started_at=now,
                started_by=who(),
                weights=dict(live.models[model].traffic),
                shadow=live.models[model].shadow is not None,
                overrides=overrides,
                checklist=checklist_record(items),
            )
            blocking = [item for item in items if item.blocks]
            if blocking:
                reason = "refused by the checklist: " + "; ".join(
                    f"{item.name}: {item.detail}" for item in blocking
                )
                state = state.model_copy(
                    update={"status": "refused", "ended_at": now, "reason": reason}
                )
                self.store.save(state)
                self.store.record("refused", state, reason=reason, overrides=overrides)
                return Ending(Outcome.REFUSED, reason)
            state = state.model_copy(update={"pid": _pid()})
            self.store.save(state)
            self.store.record(
                "started",
                state,
                strategy=plan.strategy,
                overrides=overrides,
                checklist=state.checklist,
            )
            for name, reason in overrides.items():
                self.store.record("override", state, item=name, reason=reason)
            self.say(
                f"rollout {state.id}: {model} {baseline} -> {version} ({plan.strategy}, "
                f"{len(plan.steps)} steps, analysis every {plan.analysis.interval})"
            )
            return self._drive(state)

    def _refused(self, reason: str) -> Ending:
        return Ending(Outcome.REFUSED, reason)

    @staticmethod
    def _baseline(live: ResolvedSpec, model: str, version: str) -> str:
        if model not in live.models:
            raise ControllerError(f"model {model!r} is not served; served: {sorted(live.models)}")
        spec = live.models[model]
        if version not in spec.versions:
            raise ControllerError(
                f"version {version!r} of {model!r} is not in the running spec (versions: "
                f"{sorted(spec.versions)}); add it first: servemesh apply FILE"
            )
        full = [v for v, w in spec.traffic.items() if w == 100]
        if not full:
            split = " ".join(f"{v}={w}" for v, w in sorted(spec.traffic.items()) if w)
            raise ControllerError(
                f"model {model!r} is split ({split}); a rollout starts from one version "
                "taking 100% (servemesh routes set)"
            )
        if full[0] == version:
            raise ControllerError(f"{model} {version} already takes 100% of traffic")
        return full[0]

    @staticmethod
    def _unknown_overrides(overrides: Mapping[str, str], items: Sequence[ChecklistItem]) -> None:
        known = {item.name for item in items} | {"shadow_latency", "distribution"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ControllerError(
                f"--override {', '.join(unknown)}: no such checklist item; items: "
                f"{', '.join(sorted(known))}"
            )

    # --- continuing -------------------------------------------------------------------------

    def resume(self, model: str) -> Ending | None:
        """Clear a pause; with no live controller, become it and continue from the recorded
        step. None: a live controller continues by itself."""
        state = self._active(model)
        if state.pause is not None:
            state = self.store.update(model, lambda s: s.model_copy(update={"pause": None}))
            self.store.record("resumed", state, who=who())
        if self.store.alive(model):
            return None
        expired = self.expire_if_due(model)
        if expired is not None:
            return Ending(Outcome.ROLLED_BACK, expired.reason)
        with self.store.controlling(model) as mine:
            if not mine:
                return None  # another resume won the race and drives it
            state = self.store.update(model, lambda s: s.model_copy(update={"pid": _pid()}))
            self.store.record("controller", state, who=who(), note="resumed after its crash")
            self.say(f"rollout {state.id}: {model} continues at step {state.step_label}")
            return self._drive(state)

    def request(self, model: str, kind: str, reason: str = "") -> RolloutState:
        """Record an operator's pause, abort or promote for the controller to act on."""
        if kind not in ("pause", "abort", "promote"):
            raise ValueError(f"unknown request {kind!r}")
        self._active(model)
        ask = Request(who=who(), at=self.now(), reason=reason)
        state = self.store.update(model, lambda s: s.model_copy(update={kind: ask}))
        self.store.record(f"{kind} requested", state, who=ask.who, reason=reason)
        return state

    def take_over(self, model: str) -> Ending | None:
        """Act on a recorded abort or promote when no controller is alive to do it. None:
        a live controller will."""
        with self.store.controlling(model) as mine:
            if not mine:
                return None
            state = self._active(model)
            if state.abort is not None:
                return self._roll_back(state, self._abort_reason(state), status="aborted")
            if state.promote is not None:
                return self._promote(state)
            raise ControllerError(f"nothing to do for the rollout of {model}")

    def wait_for_end(self, model: str, timeout_s: float) -> RolloutState:
        """Wait (on the injected clock) until the rollout of `model` is no longer running,
        or its controller died; the state then."""
        deadline = self.now() + timeout_s
        while True:
            state = self.store.load(model)
            if state is None or not state.active or not self.store.alive(model):
                return state or self._active(model)
            if self.now() > deadline:
                raise ControllerError(
                    f"the controller of {model} did not act within {timeout_s:.0f} s"
                )
            self.parts.sleep(0.1)

    def _active(self, model: str) -> RolloutState:
        state = self.store.load(model)
        if state is None:
            raise ControllerError(f"no rollout of {model!r} has been recorded")
        if not state.active:
            raise ControllerError(
                f"the last rollout of {model} ({state.version}) has ended: {state.status}"
                + (f" ({state.reason})" if state.reason else "")
            )
        return state

    # --- the deadline -----------------------------------------------------------------------

    def expire_if_due(self, model: str) -> RolloutState | None:
        """Roll back a rollout nobody drives that is older than its plan's deadline; its
        state afterwards, or None when there was nothing to do."""
        state = self.store.load(model)
        if state is None or not state.active or self.store.alive(model):
            return None
        age = self.now() - state.started_at
        if age <= state.plan.deadline_s:
            return None
        with self.store.controlling(model) as mine:
            if not mine:
                return None
            reason = (
                f"deadline: the rollout was left without a controller at step "
                f"{state.step_label} and is {age / 60:.0f} min old (plan deadline "
                f"{state.plan.deadline})"
            )
            self._roll_back(state, reason, status="rolled_back")
        return self.store.load(model)

    # --- driving ----------------------------------------------------------------------------

    def _drive(self, state: RolloutState) -> Ending:
        try:
            if state.strategy in ("canary", "shadow-only"):
                return self._run_steps(state)
            return self._run_fleet(state)
        except ApplyError as exc:
            # A step's route change failed (Envoy did not take it): back to the baseline.
            return self._roll_back(self._reload(state), f"a route change failed: {exc}")
        except ControllerError:
            raise
        except Exception as exc:
            # A canary nobody can judge (metrics unreadable, a part's bug) must not keep
            # its traffic: back to the baseline, saying why. (A kill or Ctrl-C is no
            # Exception: the rollout then stays recorded for `resume` or its deadline.)
            return self._roll_back(
                self._reload(state), f"the controller failed: {type(exc).__name__}: {exc}"
            )

    def _set(self, model: str, **fields: Any) -> RolloutState:
        """Record fields of the model's state (under its update lock)."""
        return self.store.update(model, lambda s: s.model_copy(update=fields))

    def _reload(self, state: RolloutState) -> RolloutState:
        return self.store.load(state.model) or state

    def _run_steps(self, state: RolloutState) -> Ending:
        steps = state.plan.steps
        if state.strategy == "shadow-only":
            if not steps[0].shadow:
                raise ControllerError("--strategy shadow-only: the plan has no shadow step")
            steps = steps[:1]
        index = max(state.step, 0)
        while index < len(steps):
            ending, state = self._run_step(state, index)
            if ending is not None:
                return ending
            index += 1
        if state.strategy == "shadow-only":
            self._change(lambda: self.parts.routes.set_shadow(state.model, None, who=_actor()))
            reason = f"shadow step passed: {state.version} judged healthy; shadow off"
            return self._end(state, "promoted", reason, Outcome.PROMOTED, shadow=False)
        return self._end(
            state,
            "promoted",
            f"{state.version} takes 100% of {state.model}; {state.baseline} stays available "
            "for a rollback",
            Outcome.PROMOTED,
        )

    def _run_step(self, state: RolloutState, index: int) -> tuple[Ending | None, RolloutState]:
        plan = state.plan
        step = plan.steps[index]
        model, version, baseline = state.model, state.version, state.baseline
        weights = (
            {baseline: 100, version: 0}
            if step.shadow
            else {baseline: 100 - (step.weight or 0), version: step.weight or 0}
        )
        # Recorded before it is applied: a controller killed in between re-applies it.
        state = self._set(model, step=index, step_applied=False, last_checks=[])
        if step.shadow:
            self._change(lambda: self.parts.routes.set_shadow(model, version, 100.0, who=_actor()))
        else:
            if self._shadow_live(model):
                self._change(lambda: self.parts.routes.set_shadow(model, None, who=_actor()))
            self._change(lambda: self.parts.routes.set_weights(model, weights, who=_actor()))
        # Recorded once Envoy serves it: the step's window starts here.
        state = self._set(
            model,
            step_applied=True,
            step_started_at=self.now(),
            weights=weights,
            shadow=step.shadow,
        )
        self.store.record("step", state, weights=weights, shadow=step.shadow)
        self.say(
            f"step {step.label} ({index + 1}/{len(plan.steps)}): "
            f"{describe_step(step, model, version, baseline)}"
        )
        if step.weight == 100 and state.reference_baseline is not None:
            # Compared with a calm window of the step before, the first interval after the
            # swap would also judge the change's own cost (Envoy validating the config,
            # every service re-reading the spec: calls queued meanwhile answer late), which
            # both arms of a split step share but the reference does not. Give it one.
            self.parts.sleep(plan.analysis.interval_s)
        began = self.now()
        before = self.parts.source.snapshot(model, shadow=step.shadow)
        # A split step judges latency on a window that starts one interval in: the first
        # calls after a route change carry its own cost, and the canary's most of all (its
        # cluster's first connections and TLS handshakes, the gateways' first call of the
        # changed model), which made an unchanged version look 2-3x slower over its first
        # few dozen calls. Errors and scores are judged from the step's first call.
        settles = not step.shadow and step.weight != 100
        latency_before: Any = None
        held = False
        failed_last_look: set[str] = set()
        while True:
            self.parts.sleep(plan.analysis.interval_s)
            state = self._reload(state)
            if state.abort is not None:
                return self._roll_back(state, self._abort_reason(state), status="aborted"), state
            if state.promote is not None:
                return self._promote(state), state
            after = self.parts.source.snapshot(model, shadow=step.shadow)
            windows = dict(self.parts.window(before, after))
            base = windows.get(baseline) or _empty(baseline)
            canary = windows.get(version) or _empty(version)
            if step.weight == 100 and state.reference_baseline is not None:
                base = arm_of(state.reference_baseline)
            checks = list(self.parts.judge(base, canary, plan.analysis))
            if settles:
                if latency_before is None:
                    checks = [_settling(c) if c.name == P99_CHECK else c for c in checks]
                    latency_before = after
                else:
                    late = dict(self.parts.window(latency_before, after))
                    late_checks = self.parts.judge(
                        late.get(baseline) or _empty(baseline),
                        late.get(version) or _empty(version),
                        plan.analysis,
                    )
                    late_p99 = {c.name: c for c in late_checks}.get(P99_CHECK)
                    checks = [
                        late_p99 if c.name == P99_CHECK and late_p99 is not None else c
                        for c in checks
                    ]
            checks, failed_last_look = _confirm(checks, failed_last_look)
            for check in checks:
                self.say(f"  {step.label} {check_line(check)}")
            # Calls callers pinned to a version: never judged (analysis.py), shown apart.
            pinned = pinned_between(before, after)
            if pinned:
                shown = ", ".join(f"{v} {n}" for v, n in pinned.items())
                self.say(f"  {step.label} pinned calls (not judged): {shown}")
            state = self._set(
                model,
                last_checks=[check_record(c) for c in checks],
                checked_at=self.now(),
                pinned_calls=pinned,
            )
            failed = [c for c in checks if c.verdict == "fail"]
            if failed:
                reason = f"step {step.label}: " + "; ".join(check_line(c) for c in failed)
                ending = self._roll_back(state, reason, checks=tuple(checks))
                return ending, self._reload(state)
            enough = canary.requests >= step.min_requests and (
                step.weight == 100 or base.requests >= step.min_requests
            )
            # A plan that starts at 100% has no baseline window to compare with: the
            # canary's own numbers (its checks may still fail) and the dwell decide.
            no_reference = step.weight == 100 and base.requests == 0
            done = (
                self.now() - began >= step.dwell_s
                and enough
                and (no_reference or all(c.verdict == "pass" for c in checks))
            )
            if not done:
                continue
            if state.pause is not None:
                if not held:
                    self.say(f"step {step.label} done; held: paused by {state.pause.who}")
                    held = True
                continue
            if step.weight != 100 and base.requests:
                state = self._set(model, reference_baseline=window_record(base))
            if step.shadow:
                refused = self._shadow_checklist(state, windows, base, canary)
                if refused is not None:
                    return refused, self._reload(state)
            self.say(f"step {step.label} passed after {self.now() - began:.1f} s")
            return None, state

    def _shadow_checklist(
        self,
        state: RolloutState,
        windows: Mapping[str, ArmWindow],
        base: ArmWindow,
        canary: ArmWindow,
    ) -> Ending | None:
        """The checklist items judged on shadow traffic; a blocking one ends the rollout
        (refused: no caller ever got the canary's answers), the shadow turned off first."""
        slo: SloSpec | None = self.parts.routes.live_spec().rollout.slos.get(state.model)
        arms = {**windows, state.baseline: base, state.version: canary}
        items = list(
            self.parts.after_shadow(
                arms,
                state.baseline,
                state.version,
                state.plan,
                slo,
                overrides=state.overrides,
            )
        )
        self.show(self.parts.render_checklist(items))
        state = self.store.update(
            state.model,
            lambda s: s.model_copy(update={"checklist": s.checklist + checklist_record(items)}),
        )
        blocking = [item for item in items if item.blocks]
        if not blocking:
            return None
        reason = "refused by the checklist on shadow traffic: " + "; ".join(
            f"{item.name}: {item.detail}" for item in blocking
        )
        return self._roll_back(state, reason, status="refused", outcome=Outcome.REFUSED)

    def _run_fleet(self, state: RolloutState) -> Ending:
        fleet = self.parts.fleet if self.parts.fleet is not None else load_fleet()
        runner = _FLEET_RUNNERS.get(state.strategy, "")
        run = getattr(fleet, runner, None)
        if run is None:
            raise ControllerError(f"--strategy {state.strategy}: the fleet part has no {runner}")
        model = state.model

        def record(marker: str, data: dict[str, Any]) -> None:
            updated = self.store.update(
                model, lambda s: s.model_copy(update={"marker": marker, "marker_data": data})
            )
            self.store.record("marker", updated, marker=marker, data=data)

        def should_stop() -> str | None:
            current = self.store.load(model)
            if current is None:
                return None
            if current.abort is not None:
                return self._abort_reason(current)
            if current.pause is not None:
                return f"paused by {current.pause.who}"
            return None

        fields: dict[str, Any] = {
            "manager": self.parts.routes,
            "spec": self.parts.routes.live_spec(),
            "model": model,
            "version": state.version,
            "baseline": state.baseline,
            "plan": state.plan,
            "say": self.say,
            "record": record,
            "resume_from": state.marker,
            "should_stop": should_stop,
        }
        if "watch" in _field_names(fleet.StrategyContext):
            fields["watch"] = self._watcher(state)
        ending: Ending = run(fleet.StrategyContext(**fields))
        status = {
            Outcome.PROMOTED: "promoted",
            Outcome.ROLLED_BACK: "rolled_back",
            Outcome.REFUSED: "refused",
        }.get(ending.outcome)
        if status is not None:
            state = self._reload(state)
            if state.abort is not None and ending.outcome == Outcome.ROLLED_BACK:
                status = "aborted"
            self._finish(state, status, ending.reason)
        return ending

    def _watcher(self, state: RolloutState) -> Callable[[], Ending | None]:
        """The analysis a fleet strategy asks for once the new version takes all traffic:
        the canary judged every interval for the plan's last step (its dwell and
        minimum requests) against the baseline's window from the rollout's start to the
        switch. An Ending when a check failed (the strategy switches back), else None."""
        model, baseline, version = state.model, state.baseline, state.version
        plan = state.plan
        last = plan.steps[-1]
        reference_from = self.parts.source.snapshot(model, shadow=False)

        def watch() -> Ending | None:
            switched = self.parts.source.snapshot(model, shadow=False)
            base = self.parts.window(reference_from, switched).get(baseline) or _empty(baseline)
            began = self.now()
            # Without a baseline window (no traffic before the switch) nothing compares:
            # the dwell alone is waited out, and a failing check still counts.
            patience = last.dwell_s + 10 * plan.analysis.interval_s
            failed_last_look: set[str] = set()
            while True:
                self.parts.sleep(plan.analysis.interval_s)
                after = self.parts.source.snapshot(model, shadow=False)
                canary = self.parts.window(switched, after).get(version) or _empty(version)
                judged = list(self.parts.judge(base, canary, plan.analysis))
                checks, failed_last_look = _confirm(judged, failed_last_look)
                for check in checks:
                    self.say(f"  {state.strategy} {check_line(check)}")
                self._set(model, last_checks=[check_record(c) for c in checks])
                failed = [c for c in checks if c.verdict == "fail"]
                if failed:
                    reason = f"{state.strategy}: " + "; ".join(check_line(c) for c in failed)
                    self.store.record("rolling back", self._reload(state), reason=reason)
                    return Ending(Outcome.ROLLED_BACK, reason, tuple(checks))
                waited = self.now() - began
                if waited >= last.dwell_s and canary.requests >= last.min_requests:
                    if all(c.verdict == "pass" for c in checks) or waited >= patience:
                        return None

        return watch

    # --- endings ----------------------------------------------------------------------------

    def _abort_reason(self, state: RolloutState) -> str:
        ask = state.abort
        assert ask is not None
        why = f": {ask.reason}" if ask.reason else ""
        return f"aborted by {ask.who} at step {state.step_label}{why}"

    def _roll_back(
        self,
        state: RolloutState,
        reason: str,
        *,
        status: str = "rolled_back",
        outcome: Outcome = Outcome.ROLLED_BACK,
        checks: tuple[Check, ...] = (),
    ) -> Ending:
        """Baseline 100, shadow off, as one act: whatever the canary got is taken away."""
        self.say(f"rolling back: {reason}")
        self.store.record("rolling back", state, reason=reason)
        model = state.model
        if self._shadow_live(model):
            self._change(lambda: self.parts.routes.set_shadow(model, None, who=_actor()))
        live = self.parts.routes.live_spec().models[model].traffic
        if live.get(state.baseline) != 100:
            weights = {state.baseline: 100}
            self._change(lambda: self.parts.routes.set_weights(model, weights, who=_actor()))
        return self._end(
            state, status, reason, outcome, checks=checks, weights={state.baseline: 100}
        )

    def _promote(self, state: RolloutState) -> Ending:
        ask = state.promote
        by = f" by {ask.who}" if ask is not None else ""
        model = state.model
        self.say(f"promoting{by}: {state.version} takes 100% now")
        if self._shadow_live(model):
            self._change(lambda: self.parts.routes.set_shadow(model, None, who=_actor()))
        weights = {state.version: 100}
        self._change(lambda: self.parts.routes.set_weights(model, weights, who=_actor()))
        reason = f"promoted{by} at step {state.step_label}: {state.version} takes 100% of {model}"
        return self._end(state, "promoted", reason, Outcome.PROMOTED, weights=weights)

    def _end(
        self,
        state: RolloutState,
        status: str,
        reason: str,
        outcome: Outcome,
        *,
        checks: tuple[Check, ...] = (),
        weights: dict[str, int] | None = None,
        shadow: bool | None = None,
    ) -> Ending:
        self._finish(state, status, reason, weights=weights, shadow=shadow)
        return Ending(outcome, reason, checks)

    def _finish(
        self,
        state: RolloutState,
        status: str,
        reason: str,
        *,
        weights: dict[str, int] | None = None,
        shadow: bool | None = None,
    ) -> None:
        update: dict[str, Any] = {"status": status, "reason": reason, "ended_at": self.now()}
        if weights is not None:
            update["weights"] = weights
            update["shadow"] = False
        if shadow is not None:
            update["shadow"] = shadow
        ended = self.store.update(state.model, lambda s: s.model_copy(update=update))
        self.store.record(status, ended, reason=reason)

    # --- routes -----------------------------------------------------------------------------

    def _shadow_live(self, model: str) -> bool:
        return self.parts.routes.live_spec().models[model].shadow is not None

    def _change(self, apply: Callable[[], object]) -> None:
        """Apply a route change, waiting out another change of the mesh under way (the mesh
        takes one at a time and refuses a second at once)."""
        deadline = self.now() + CHANGE_LOCK_WAIT_S
        while True:
            try:
                apply()
                return
            except ApplyError as exc:
                if _LOCK_BUSY not in str(exc) or self.now() > deadline:
                    raise
            self.parts.sleep(0.2)


def _field_names(kind: Any) -> set[str]:
    import dataclasses

    if dataclasses.is_dataclass(kind):
        return {f.name for f in dataclasses.fields(kind)}
    return set()


def _pid() -> int:
    return os.getpid()


def _actor() -> str:
    return "servemesh rollout"


@dataclass
class StartRequest:
    """What `servemesh rollout start` asks for, checked."""

    model: str
    version: str
    plan: RolloutPlan
    overrides: dict[str, str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        model: str,
        version: str,
        plan: RolloutPlan,
        strategy: Strategy | None,
        overrides: Sequence[str],
        reasons: Sequence[str],
    ) -> StartRequest:
        if len(overrides) != len(reasons):
            raise ControllerError(
                f"--override: each needs its own --reason (got {len(overrides)} overrides "
                f"and {len(reasons)} reasons)"
            )
        for name, reason in zip(overrides, reasons, strict=True):
            if not reason.strip():
                raise ControllerError(f"--reason for --override {name}: must not be empty")
        if strategy is not None and strategy != plan.strategy:
            plan = plan.model_copy(update={"strategy": strategy})
        return cls(model, version, plan, dict(zip(overrides, reasons, strict=True)))
