"""Run a drill file with Chaos Toolkit, with live progress, and return its verdict.

This is what `servemesh chaos run FILE` does; `chaos run FILE` (the Chaos Toolkit CLI) runs
the same file, since the drill's work happens in its control, actions and probes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from chaoslib.exceptions import ChaosException
from chaoslib.experiment import ensure_experiment_is_valid, run_experiment
from chaoslib.run import RunEventHandler
from chaoslib.types import Strategy
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from servemesh.chaos import control
from servemesh.chaos.drill import DEFAULTS, EXPERIMENTS_DIR, slug
from servemesh.contract.errors import ServemeshError


class DrillFileError(ServemeshError, ValueError):
    """The drill file cannot be read or is not a valid experiment."""


@dataclass
class DrillResult:
    verdict: str
    text: str
    summary: dict[str, Any]
    journal: dict[str, Any]
    out_dir: Path

    @property
    def ok(self) -> bool:
        return self.verdict == "held"


def resolve_experiment(value: str | Path) -> Path:
    """A file as given, else chaos/experiments/<value>(.yaml)."""
    path = Path(value)
    if path.is_file():
        return path
    for candidate in (EXPERIMENTS_DIR / str(value), EXPERIMENTS_DIR / f"{value}.yaml"):
        if candidate.is_file():
            return candidate
    raise DrillFileError(f"no drill file {str(value)!r} (see `servemesh chaos list`)")


def load_experiment(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise DrillFileError(f"{path}: cannot read the drill: {exc}") from None
    if not isinstance(data, dict):
        raise DrillFileError(f"{path}: a drill is a mapping (a Chaos Toolkit experiment)")
    return data


def list_drills() -> list[dict[str, Any]]:
    """Every drill shipped in chaos/experiments/, with what it proves."""
    drills = []
    for path in sorted(EXPERIMENTS_DIR.glob("*.y*ml")):
        data = load_experiment(path)
        hypo = data.get("steady-state-hypothesis", {})
        drills.append(
            {
                "name": path.stem,
                "file": str(path),
                "title": data.get("title", ""),
                "proves": data.get("description", "").strip(),
                "slo": hypo.get("title", ""),
                "tags": data.get("tags", []),
            }
        )
    return drills


class _Progress(RunEventHandler):
    """Prints each step of the experiment as it happens."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.started = time.perf_counter()

    def _t(self) -> str:
        drill = control.active()
        t = drill.now_s() if drill is not None and drill.load is not None else 0.0
        return f"[dim]t={t:6.1f}s[/dim]"

    def start_activity(self, activity: dict[str, Any]) -> None:
        kind = activity.get("type", "activity")
        self.console.print(f"{self._t()} [cyan]{kind}[/cyan] {activity.get('name')} ...")

    def activity_completed(self, activity: dict[str, Any], run: dict[str, Any]) -> None:
        status = run.get("status")
        mark = "[green]ok[/green]" if status == "succeeded" else f"[red]{status}[/red]"
        detail = ""
        output = run.get("output")
        if isinstance(output, int | float | bool):
            detail = f" -> {output}"
        if status != "succeeded" and run.get("exception"):
            detail = f" -> {run['exception'][-1].strip()[:160]}"
        self.console.print(
            f"{self._t()}   {mark} {escape(str(activity.get('name')))}{escape(detail)}"
        )
        reason = outcome_reason(output)
        if reason:
            # What the runbooks tell an operator to look for: a rollout's last line names
            # each failed check (`rolled back: step 10%: error_ratio fail: ...`).
            self.console.print(f"{self._t()}     {escape(reason)}")

    def hypothesis_before_completed(self, experiment: Any, state: Any, journal: Any) -> None:
        self._steady("before", state)

    def hypothesis_after_completed(self, experiment: Any, state: Any, journal: Any) -> None:
        self._steady("after", state)

    def _steady(self, when: str, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        met = state.get("steady_state_met")
        colour = "green" if met else "red"
        self.console.print(
            f"{self._t()} steady state {when}: [{colour}]{'met' if met else 'NOT met'}[/{colour}]"
        )
        for line in missed_probes(state):
            self.console.print(f"{self._t()}   [red]{escape(line)}[/red]")

    def start_rollbacks(self, experiment: Any) -> None:
        self.console.print(f"{self._t()} [yellow]rollbacks[/yellow]")

    def interrupted(self, experiment: Any, journal: Any) -> None:
        drill = control.active()
        reason = drill.guard.reason if drill is not None and drill.guard.tripped else "interrupted"
        self.console.print(f"{self._t()} [red]method interrupted: {reason}[/red]")


def outcome_reason(output: object) -> str:
    """The reason an activity's outcome carries (a rollout's: `run_rollout`'s last line of
    `servemesh rollout start`), "" for any other output."""
    if isinstance(output, dict) and output.get("outcome") and output.get("reason"):
        return str(output["reason"])
    return ""


def missed_probes(state: dict[str, Any]) -> list[str]:
    """Each steady-state probe that did not hold, with what it read and what it allows."""
    lines = []
    for run in state.get("probes") or []:
        if run.get("tolerance_met", True):
            continue
        activity = run.get("activity") or {}
        name = activity.get("name", "probe")
        if run.get("status") == "failed":
            error = (run.get("exception") or ["no answer"])[-1].strip()[:160]
            lines.append(f"{name}: failed: {error}")
        else:
            lines.append(f"{name}: {run.get('output')}, allowed {activity.get('tolerance')}")
    return lines


def _live_view() -> Any:
    drill = control.active()
    if drill is None or drill.load is None:
        return Text("starting the drill's mesh...", style="dim")
    status = drill.status_line()
    stats = status["stats"]
    table = Table.grid(padding=(0, 2))
    table.add_row(
        Text(f"t={status['t']:.1f}s", style="bold"),
        Text(status["phase"], style="cyan"),
        Text(
            f"last 5 s: {stats.sent} sent, {stats.success_pct:.2f}% ok, "
            f"{(stats.degraded_pct if stats.ok else 0):.1f}% degraded, "
            f"p50 {stats.p50_ms:.0f} ms, p99 {stats.p99_ms:.0f} ms"
            if stats.sent
            else "last 5 s: no calls yet"
        ),
    )
    zones = ", ".join(f"{z} {v:.0f}%" for z, v in stats.zones.items()) or "-"
    versions = ", ".join(f"{v} {s:.0f}%" for v, s in stats.versions.items()) or "-"
    faults = ", ".join(status["faults"]) or "none"
    guard = status["guard"]
    guard_text = (
        f"TRIPPED: {guard.reason}"
        if guard.tripped
        else ("armed" if guard.armed else "off")
        + f" (< {guard.min_success_pct:g}% for {guard.for_s:g} s)"
    )
    table.add_row("", "zones", zones)
    table.add_row("", "versions", versions)
    table.add_row("", "faults", Text(faults, style="red" if status["faults"] else "green"))
    table.add_row("", "guard", Text(guard_text, style="red" if guard.tripped else ""))
    return Group(table)


def default_out_dir(path: Path) -> Path:
    return Path("chaos-runs") / f"{slug(path.stem)}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def run_drill(
    file: str | Path,
    *,
    spec: str | None = None,
    out_dir: str | Path | None = None,
    variables: dict[str, Any] | None = None,
    console: Console | None = None,
    live: bool = False,
) -> DrillResult:
    """Run one drill file; `spec`, `out_dir` and `variables` override its configuration."""
    path = resolve_experiment(file)
    experiment = load_experiment(path)
    overrides = dict(variables or {})
    if spec:
        overrides["spec"] = str(Path(spec).resolve()) if Path(spec).is_file() else spec
    out = Path(out_dir) if out_dir else default_out_dir(path)
    out.mkdir(parents=True, exist_ok=True)
    overrides["out_dir"] = str(out.resolve())
    configuration = experiment.setdefault("configuration", {})
    unknown = sorted(set(overrides) - set(configuration) - set(DEFAULTS))
    if unknown:
        known = sorted(set(configuration) | set(DEFAULTS))
        raise DrillFileError(f"{path}: no configuration key {unknown}; known: {known}")
    configuration.update(overrides)
    # Activities may name a default the file leaves out (`${recover_early}`); Chaos Toolkit
    # would pass such a name on as its literal text.
    for key, value in DEFAULTS.items():
        configuration.setdefault(key, value)

    # Chaos Toolkit logs to its own logger: into the run's folder, not over the live view.
    ctk = logging.getLogger("chaostoolkit")
    handler = logging.FileHandler(out / "chaostoolkit.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    ctk.addHandler(handler)
    ctk.setLevel(logging.INFO)
    ctk.propagate = False
    try:
        try:
            ensure_experiment_is_valid(experiment)
        except ChaosException as exc:
            raise DrillFileError(f"{path}: not a valid experiment: {exc}") from None
        runtime = experiment.get("runtime", {})
        settings = {
            "runtime": {
                "rollbacks": {"strategy": runtime.get("rollbacks", {}).get("strategy", "always")},
                "hypothesis": {"strategy": "default"},
            }
        }
        console = console or Console(stderr=True)
        handlers = [_Progress(console)] if live else []
        kwargs: dict[str, Any] = {
            "settings": settings,
            "strategy": Strategy.DEFAULT,
            "event_handlers": handlers,
        }
        if live:
            with Live(
                get_renderable=_live_view, console=console, refresh_per_second=2, transient=True
            ):
                journal = run_experiment(experiment, **kwargs)
        else:
            journal = run_experiment(experiment, **kwargs)
    finally:
        ctk.removeHandler(handler)
        handler.close()
    summary = journal.get("servemesh") or {}
    verdict = summary.get("verdict", "error")
    text = summary.get("verdict_text", f"no report was written (status {journal.get('status')})")
    return DrillResult(verdict, text, summary, journal, out)
