"""The Chaos Toolkit control every servemesh drill declares: it runs the drill around the
experiment and stops it early when the guard trips.

    controls:
      - name: servemesh-drill
        provider: {type: python, module: servemesh.chaos.control}

- before the experiment: start a mesh from the configured spec (free ports, in the run's
  folder), start the background load, observe the baseline;
- during the method: arm the guard; as soon as it trips (or a fault cannot be injected),
  interrupt the method, so Chaos Toolkit goes straight to the rollbacks (experiments set
  `runtime.rollbacks.strategy: always`, so rollbacks run after an interruption too);
- after the experiment (rollbacks done): keep the load a few seconds more, then write the
  report (Markdown, PNG timeline, summary JSON) and add the summary to the journal;
- cleanup: stop whatever a fault left running, the load and the mesh, by PID.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from chaoslib.exceptions import InterruptExecution

from servemesh.chaos.drill import Drill
from servemesh.chaos.report import summarize, write_report

log = logging.getLogger(__name__)

_drill: Drill | None = None


def active() -> Drill | None:
    return _drill


def before_experiment_control(
    context: dict[str, Any], configuration: dict[str, Any] | None = None, **_: Any
) -> None:
    global _drill
    drill = Drill(str(context.get("title", "drill")), configuration)
    _drill = drill
    drill.experiment_title = str(context.get("title", ""))
    try:
        drill.start()
    except Exception as exc:
        drill.start_error = f"{type(exc).__name__}: {exc}"
        log.error("the drill could not start: %s", drill.start_error)
        raise InterruptExecution(f"the drill could not start: {drill.start_error}") from None


def before_hypothesis_control(context: dict[str, Any], **_: Any) -> None:
    if _drill is None:
        return
    after = _drill.phase not in ("starting", "baseline")
    _drill.phase = "steady state after" if after else "steady state before"
    _drill.timeline.mark(_drill.phase, "phase")


def before_method_control(context: dict[str, Any], **_: Any) -> None:
    if _drill is None:
        return
    _drill.phase = "method"
    _drill.timeline.mark("method", "phase")
    _drill.guard.arm()


def after_method_control(context: dict[str, Any], **_: Any) -> None:
    if _drill is not None:
        _drill.guard.disarm()


def before_activity_control(context: dict[str, Any], **_: Any) -> None:
    if _drill is None:
        return
    if _drill.phase == "method" and _drill.abort.is_set():
        raise InterruptExecution(f"aborted by the guard: {_drill.guard.reason}")
    if _drill.phase in ("method", "rollbacks"):
        _drill.timeline.mark(str(context.get("name", "?")))


def after_activity_control(
    context: dict[str, Any], state: dict[str, Any] | None = None, **_: Any
) -> None:
    if _drill is None or _drill.phase != "method":
        return
    if _drill.abort.is_set():
        raise InterruptExecution(f"aborted by the guard: {_drill.guard.reason}")
    if state and state.get("status") == "failed":
        reason = _plain((state.get("exception") or ["failed"])[-1])
        _drill.failed_activity = f"{context.get('name')}: {reason}"
        raise InterruptExecution(f"{context.get('name')} failed, stopping the drill: {reason}")


def _plain(error: str) -> str:
    """'chaoslib...ActivityFailed: servemesh...DrillError: the message' -> 'the message'."""
    text = error.strip()
    while re.match(r"^[\w.]+(Error|Exception|Failed): ", text):
        text = text.split(": ", 1)[1]
    return text


def before_rollback_control(context: dict[str, Any], **_: Any) -> None:
    if _drill is None:
        return
    _drill.guard.disarm()
    _drill.phase = "rollbacks"
    _drill.timeline.mark("rollbacks", "phase")


def after_rollback_control(context: dict[str, Any], **_: Any) -> None:
    if _drill is not None:
        _drill.phase = "after rollbacks"


def after_experiment_control(
    context: dict[str, Any], state: dict[str, Any] | None = None, **_: Any
) -> None:
    if _drill is None:
        return
    journal = state or {}
    try:
        _drill.finish()
        summary = summarize(_drill, journal)
        files = write_report(_drill, summary, journal)
        _drill.summary = {**summary.as_dict(), "files": files}
        journal["servemesh"] = _drill.summary
    except Exception:
        log.exception("the drill's report could not be written")
        raise


def cleanup_control() -> None:
    global _drill
    drill, _drill = _drill, None
    if drill is not None:
        drill.close()
