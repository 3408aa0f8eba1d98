"""`servemesh rollout ...`: start, watch and steer progressive rollouts.

Exit statuses of `start` and `resume` (servemesh/contract/errors.py): 0 promoted, 3 rolled back (the
reason printed last), 4 refused (a gate, the checklist, or a rollout already under way), 1
an error of the command itself (unknown model or version, bad plan file), 2 no running mesh.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from servemesh.cli.flags import add_gate_overrides, add_output
from servemesh.cli.mesh import add_mesh_flags, recorded_state_dir, running_mesh
from servemesh.cli.output import console, out, write
from servemesh.proxy.admin import AdminError
from servemesh.proxy.apply import RouteManager
from servemesh.rollout.controller import Controller, ControllerError, Parts, StartRequest
from servemesh.rollout.types import Ending, Outcome
from servemesh.spec import SpecError
from servemesh.spec.rollout_plan import RolloutPlan
from servemesh.state.paths import ApplyError, MeshPaths
from servemesh.state.rollouts import RolloutState, StateStore

_VERDICT_STYLE = {" pass:": "green", " fail:": "bold red", " wait:": "yellow"}
# How long `abort` and `promote` wait for a live controller to act (it reads its flags
# every analysis interval, then changes the routes).
ACT_TIMEOUT_S = 120.0


def say(line: str, *, to: Console | None = None) -> None:
    """One progress line: the time, then what happened (verdicts coloured)."""
    stamp = datetime.now().strftime("%H:%M:%S")
    style = next((s for key, s in _VERDICT_STYLE.items() if key in line), None)
    if line.startswith("rolling back"):
        style = "bold red"
    (to or out).print(Text.assemble((stamp + " ", "dim"), (line, style or "")))
    sys.stdout.flush()


def say_aside(line: str) -> None:
    """A progress line on stderr: for commands whose stdout is data (status --json)."""
    say(line, to=console)


def _state_dir(args: argparse.Namespace) -> Path:
    """What status, history and pause read: the rollouts recorded under the state dir (of
    a running mesh, or of a stopped one that recorded some)."""
    return recorded_state_dir(args, "rollouts")


def _missing_part(name: str) -> Any:
    def refuse(*_: Any, **__: Any) -> Any:
        raise ControllerError(f"this command does not use {name}")

    return refuse


class _NoSource:
    def snapshot(self, model: str, *, shadow: bool) -> Any:
        raise ControllerError("this command takes no snapshots")


def real_parts(manager: RouteManager, *, analysis: bool) -> Parts:
    """The mesh's own parts. The analysis and the gates are imported only by the commands
    that drive a rollout (start, resume), and only then need a running mesh's metrics."""
    if not analysis:
        return Parts(
            routes=manager,
            source=_NoSource(),
            window=_missing_part("the analysis"),
            judge=_missing_part("the analysis"),
            preflight=_missing_part("the checklist"),
            after_shadow=_missing_part("the checklist"),
            render_checklist=_missing_part("the checklist"),
        )
    try:
        analysis_mod = importlib.import_module("servemesh.rollout.analysis")
        gates = importlib.import_module("servemesh.rollout.gates")
    except ImportError as exc:
        raise ControllerError(f"this build lacks a part of the rollout: {exc}") from None
    return Parts(
        routes=manager,
        source=analysis_mod.arm_source(manager.live_spec()),
        window=analysis_mod.window,
        judge=analysis_mod.judge,
        preflight=gates.preflight,
        after_shadow=gates.after_shadow,
        render_checklist=gates.render_checklist,
    )


def _controller(
    args: argparse.Namespace, *, analysis: bool = False, aside: bool = False
) -> Controller:
    if analysis:  # start and resume drive the routes of a running mesh
        manager = RouteManager(running_mesh(args).paths)
    else:
        manager = RouteManager(MeshPaths(_state_dir(args)))
    return Controller(
        StateStore(manager.paths.state_dir),
        real_parts(manager, analysis=analysis),
        say=say_aside if aside else say,
        show=console.print if aside else out.print,
    )


def load_plan(path: str) -> RolloutPlan:
    """A plan file: the content of the spec's `rollout.plan` (steps, analysis, checklist,
    deadline, strategy), as YAML. Errors name the file and the field."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ControllerError(f"--plan {path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ControllerError(f"--plan {path}: malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ControllerError(f"--plan {path}: a plan is a mapping (steps, analysis, ...)")
    try:
        return RolloutPlan.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'plan'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ControllerError(f"--plan {path}: {problems}") from None


def _finish(ending: Ending) -> int:
    """The reason is the last line printed: what an operator (or a script's log) keeps."""
    word = {
        Outcome.PROMOTED: "promoted",
        Outcome.ROLLED_BACK: "rolled back",
        Outcome.REFUSED: "refused",
    }.get(ending.outcome, "failed")
    style = "green" if ending.outcome == Outcome.PROMOTED else "bold red"
    out.print(Text.assemble((f"{word}: ", style), ending.reason))
    return int(ending.outcome)


def cmd_start(args: argparse.Namespace) -> int:
    controller = _controller(args, analysis=True)
    plan = load_plan(args.plan) if args.plan else controller.parts.routes.live_spec().rollout.plan
    request = StartRequest.build(
        args.model, args.version, plan, args.strategy, args.override or [], args.reason or []
    )
    return _finish(
        controller.start(request.model, request.version, request.plan, overrides=request.overrides)
    )


def cmd_resume(args: argparse.Namespace) -> int:
    controller = _controller(args, analysis=True)
    ending = controller.resume(args.model)
    if ending is None:
        out.print(f"resumed: the controller of {args.model} continues")
        return 0
    return _finish(ending)


def cmd_pause(args: argparse.Namespace) -> int:
    controller = _controller(args)
    state = controller.request(args.model, "pause", args.reason or "")
    alive = controller.store.alive(args.model)
    out.print(
        f"paused: {args.model} holds at step {state.step_label}"
        + ("" if alive else " (no controller is running; `rollout resume` continues it)")
    )
    return 0


def _act(args: argparse.Namespace, kind: str) -> int:
    controller = _controller(args)
    controller.request(args.model, kind, args.reason or "")
    ending = controller.take_over(args.model)
    if ending is None:  # a live controller acts on it at its next interval
        state = controller.wait_for_end(args.model, ACT_TIMEOUT_S)
        if state.active:
            raise ControllerError(
                f"the controller of {args.model} died before acting; run `servemesh rollout "
                f"{kind} {args.model}` again"
            )
        ending = Ending(
            Outcome.PROMOTED if state.status == "promoted" else Outcome.ROLLED_BACK,
            state.reason,
        )
    _finish(ending)
    return 0


def cmd_abort(args: argparse.Namespace) -> int:
    return _act(args, "abort")


def cmd_promote(args: argparse.Namespace) -> int:
    return _act(args, "promote")


def _age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def status_row(state: RolloutState, alive: bool, now: float) -> dict[str, Any]:
    deadline_at = state.started_at + state.plan.deadline_s
    return {
        "model": state.model,
        "version": state.version,
        "baseline": state.baseline,
        "strategy": state.strategy,
        "status": state.status,
        "step": state.step_label,
        "step_index": state.step,
        # False between recording a step and Envoy serving it (or a controller killed then).
        "step_applied": state.step_applied or state.step < 0,
        "steps": [s.label for s in state.plan.steps],
        "weights": state.weights,
        "shadow": state.shadow,
        "in_step_s": (
            round(now - state.step_started_at, 1)
            if state.step_started_at and state.active
            else None
        ),
        "controller_alive": alive,
        "pid": state.pid,
        "paused": state.pause is not None,
        "deadline": datetime.fromtimestamp(deadline_at, UTC).isoformat(timespec="seconds"),
        "deadline_in_s": round(deadline_at - now, 1) if state.active else None,
        "last_checks": [c.model_dump() for c in state.last_checks],
        "pinned_calls": dict(state.pinned_calls),
        "reason": state.reason,
        "overrides": state.overrides,
        "started_at": datetime.fromtimestamp(state.started_at, UTC).isoformat(timespec="seconds"),
        "id": state.id,
    }


def cmd_status(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    store = StateStore(state_dir)
    models = [args.model] if args.model else store.models()
    controller: Controller | None = None
    rows = []
    for model in models:
        state = store.load(model)
        if state is None:
            if args.model:
                raise ControllerError(f"no rollout of {model!r} has been recorded")
            continue
        if state.active and not store.alive(model):
            # A rollout nobody drives past its deadline is rolled back by whoever looks.
            try:
                if controller is None:
                    controller = _controller(args, aside=True)
                state = controller.expire_if_due(model) or state
            except (ControllerError, ApplyError, AdminError, SpecError) as exc:
                # Status still shows what is recorded; the next look tries again.
                console.print(
                    Text.assemble(
                        ("warning: ", "yellow"),
                        f"{model}: past its deadline, but the rollback failed: {exc}",
                    )
                )
        rows.append(status_row(state, store.alive(model), time.time()))
    if args.json:
        write(json.dumps(rows if not args.model else rows[0]))
        return 0
    if not rows:
        out.print(f"no rollouts recorded under {state_dir}")
        return 0
    for row in rows:
        _print_status(row)
    return 0


def _print_status(row: dict[str, Any]) -> None:
    table = Table(
        title=f"rollout of {row['model']}: {row['baseline']} -> {row['version']}",
        title_justify="left",
        show_header=False,
    )
    table.add_column("field", style="bold")
    table.add_column("value")
    steps = " ".join(f"[{s}]" if i == row["step_index"] else s for i, s in enumerate(row["steps"]))
    weights = " ".join(f"{v}={w}" for v, w in sorted(row["weights"].items()))
    alive = (f"alive (pid {row['pid']})" if row["controller_alive"] else "not running") + (
        " · paused" if row["paused"] else ""
    )
    deadline = row["deadline"]
    if row["deadline_in_s"] is not None:
        left = row["deadline_in_s"]
        deadline += f" (in {_age(left)})" if left > 0 else " (passed)"
    fields = [
        ("status", row["status"]),
        ("strategy", row["strategy"]),
        (
            "step",
            f"{row['step']}{'' if row['step_applied'] else ' (being applied)'}   {steps}",
        ),
        ("weights", weights + (" + shadow" if row["shadow"] else "")),
        ("in step", _age(row["in_step_s"]) if row["in_step_s"] is not None else "-"),
        ("controller", alive),
        ("deadline", deadline),
    ]
    if row["overrides"]:
        fields.append(("overrides", "; ".join(f"{k}: {v}" for k, v in row["overrides"].items())))
    for check in row["last_checks"]:
        fields.append((f"check {check['name']}", f"{check['verdict']}: {check['detail']}"))
    if row.get("pinned_calls"):
        pinned = ", ".join(f"{v} {n}" for v, n in sorted(row["pinned_calls"].items()))
        fields.append(("pinned calls", f"{pinned} (last window; not judged)"))
    if row["reason"]:
        fields.append(("reason", row["reason"]))
    for name, value in fields:
        table.add_row(name, Text(str(value)))
    out.print(table)


def cmd_history(args: argparse.Namespace) -> int:
    events = StateStore(_state_dir(args)).history(args.model)
    if args.json:
        write(json.dumps(events))
        return 0
    table = Table(title="rollout history", title_justify="left")
    for column in ("when", "model", "version", "event", "step", "detail"):
        table.add_column(column)
    for event in events:
        detail = event.get("reason") or event.get("who") or ""
        if event["event"] == "override":
            detail = f"{event.get('item')}: {event.get('reason')}"
        table.add_row(
            datetime.fromtimestamp(float(event["at"]), UTC).strftime("%Y-%m-%d %H:%M:%S"),
            str(event.get("model")),
            str(event.get("version")),
            str(event["event"]),
            str(event.get("step", "")),
            Text(str(detail)),
        )
    out.print(table)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    rollout = sub.add_parser(
        "rollout", help="progressive delivery: shadow, canary steps, automated rollback"
    )
    add_mesh_flags(rollout)
    rollout.set_defaults(
        interrupted="the rollout stays recorded at its step; `servemesh rollout resume MODEL` "
        "continues it, `servemesh rollout abort MODEL` rolls it back"
    )
    verbs = rollout.add_subparsers(dest="verb", required=True)

    start = verbs.add_parser(
        "start",
        help="roll VERSION of MODEL out step by step (exit 0 promoted, 3 rolled back, 4 refused)",
    )
    add_mesh_flags(start, inherited=True)
    start.add_argument("model")
    start.add_argument("version")
    start.add_argument("--plan", help="a plan file (YAML: steps, analysis, checklist, deadline)")
    start.add_argument(
        "--strategy", choices=["canary", "blue-green", "shadow-only", "rolling"], default=None
    )
    add_gate_overrides(
        start, "let a failed checklist item or gate through (each with its own --reason)"
    )
    start.set_defaults(func=cmd_start)

    status = verbs.add_parser("status", help="where each rollout stands")
    add_mesh_flags(status, inherited=True)
    status.add_argument("model", nargs="?")
    add_output(status)
    status.set_defaults(func=cmd_status)

    pause = verbs.add_parser("pause", help="hold the rollout at its current step")
    add_mesh_flags(pause, inherited=True)
    pause.add_argument("model")
    pause.add_argument("--reason")
    pause.set_defaults(func=cmd_pause)

    resume = verbs.add_parser(
        "resume", help="continue a paused rollout, or one whose controller died"
    )
    add_mesh_flags(resume, inherited=True)
    resume.add_argument("model")
    resume.set_defaults(func=cmd_resume)

    abort = verbs.add_parser("abort", help="roll back now (recorded with who and why)")
    add_mesh_flags(abort, inherited=True)
    abort.add_argument("model")
    abort.add_argument("--reason", required=True)
    abort.set_defaults(func=cmd_abort)

    promote = verbs.add_parser("promote", help="skip the remaining steps: 100%% now")
    add_mesh_flags(promote, inherited=True)
    promote.add_argument("model")
    promote.add_argument("--reason")
    promote.set_defaults(func=cmd_promote)

    history = verbs.add_parser("history", help="every rollout event, overrides and reasons")
    add_mesh_flags(history, inherited=True)
    history.add_argument("model", nargs="?")
    add_output(history)
    history.set_defaults(func=cmd_history)
