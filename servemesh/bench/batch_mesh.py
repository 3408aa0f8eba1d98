"""`servemesh bench batch --through-mesh`: online Predict latency while a batch run scores
through the same mesh's model servers, against the same load without it, in one run.

One mesh starts from the spec with `entities` demo entities. Then, `repeats` times, the
order turning each repeat:

- online alone: c=`concurrency` Predicts of random entities through the edge for
  `seconds` (after the warm-up every `bench` round has);
- online during batch: a real `servemesh batch score --view ... --through-mesh` run (a child
  process: its own interpreter, as an operator would start it) scoring every entity of the
  view at the model's lowest batcher priority, and, once it is seen scoring (the model
  servers' ModelInfer count moves with no online load), the same online load. The round
  counts only when the batch run was still scoring when the load ended; its rows/s over
  the window is reported beside;
- online during a greedy batch: the same with `--greedy`, the run keeping its whole window
  of requests in flight instead of giving way (batch/yielding.py): what yielding buys.

The goal (issue: "through the mesh, the online p99 measured during a batch run stays within
1.5x of the p99 without it") is read from the medians of the repeats, for the default run.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from servemesh.bench.observe import bench_credentials, wait_answering
from servemesh.bench.predict import Round, bench_spec, measure, summarize_rows
from servemesh.bench.report import BenchReport, progress
from servemesh.bench.tiers import entity_target
from servemesh.contract.wire import OIP_SERVICE
from servemesh.identity import dial_every_edge
from servemesh.launcher import Mesh
from servemesh.load.stats import spread
from servemesh.observe.scrape import Sample, scrape, sum_by
from servemesh.spec import MeshSpec

ALONE, DURING, GREEDY = "online alone", "online during batch", "during greedy batch"
PHASES = (ALONE, DURING, GREEDY)
GOAL_P99_RATIO = 1.5
RPC = "servemesh_rpc_requests_total"
INFER_METHOD = f"/{OIP_SERVICE}/ModelInfer"
ROWS = "servemesh_model_inferences_total"


@dataclass(frozen=True)
class BatchWindow:
    """What the batch run did while one `during` round measured."""

    repeat: int
    greedy: bool
    rows_per_s: float  # rows the model servers scored for it over the window
    overlapped: bool  # still scoring when the online load ended


def over_model_servers(mesh: Mesh, read: Callable[[list[Sample]], float]) -> float:
    """`read` of each model server's metrics, summed over every model server."""
    return sum(
        read(scrape(mesh.spec.metrics_address_of(instance.name)))
        for instance in mesh.spec.instances()
        if instance.service == "model"
    )


def model_infer_calls(mesh: Mesh) -> float:
    """ModelInfer calls answered so far, over every model server."""

    def ok_calls(samples: list[Sample]) -> float:
        calls = sum_by(samples, RPC, ("method",), lambda labels: labels.get("code") == "OK")
        return calls.get((INFER_METHOD,), 0.0)

    return over_model_servers(mesh, ok_calls)


def model_rows(mesh: Mesh) -> float:
    """Rows the model servers answered so far (every model, every version)."""
    return over_model_servers(mesh, lambda samples: sum(sum_by(samples, ROWS, ()).values()))


class BatchRun:
    """One `servemesh batch score --through-mesh` child of the benchmark, stopped by PID."""

    def __init__(
        self, mesh: Mesh, model: str, view: str, out: Path, batch_size: int, *, greedy: bool
    ) -> None:
        self.out = out
        argv = [
            sys.executable, "-m", "servemesh", "batch", "--state-dir", str(mesh.state_dir),
            "score", "--model", model, "--view", view, "--through-mesh",
            "--batch-size", str(batch_size), "--out", str(out), "--progress", "off",
            *(["--greedy"] if greedy else []),
        ]  # fmt: skip
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Interrupt it as Ctrl-C would (it keeps a checkpoint) and reap it."""
        if self.running():
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()

    def failure(self) -> str:
        """Why it ended, when it ended badly on its own ("" otherwise)."""
        code = self.process.poll()
        if code in (None, 0, 130):
            return ""
        tail = self.process.stderr.read()[-2000:] if self.process.stderr else ""
        return f"batch score exited {code}: {tail}"


def wait_scoring(mesh: Mesh, run: BatchRun, timeout_s: float = 120.0) -> None:
    """Until the model servers answer ModelInfer calls with no online load: the batch run
    is scoring."""
    start = model_infer_calls(mesh)
    deadline = time.monotonic() + timeout_s
    while model_infer_calls(mesh) <= start:
        if not run.running():
            raise RuntimeError(run.failure() or "batch score ended before it scored a batch")
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch score made no ModelInfer call within {timeout_s:g} s")
        time.sleep(0.05)


def bench_during_batch(
    spec: MeshSpec,
    *,
    entities: int = 200_000,
    concurrency: int = 8,
    seconds: float = 6.0,
    repeats: int = 3,
    batch_size: int = 256,
    progress: Callable[[Round], None] = lambda _: None,
) -> dict[str, object]:
    spec = bench_spec(spec)
    spec = spec.model_copy(update={"demo": spec.demo.model_copy(update={"entities": entities})})
    model = next(iter(sorted(spec.models)))
    view = next(iter(spec.models[model].effective_inputs.values())).view
    assert view is not None, f"{model}: its first input comes from no view"
    ids = [f"user-{k}" for k in np.random.default_rng(0).integers(0, entities, 4096)]
    rounds: list[Round] = []
    windows: list[BatchWindow] = []
    with tempfile.TemporaryDirectory() as state:
        mesh = Mesh.from_spec(spec, Path(state))
        mesh.start()
        try:
            wait_answering(mesh)
            target = entity_target(
                dial_every_edge(mesh.spec), model, ids, bench_credentials(mesh.spec)
            )
            for repeat in range(repeats):
                turn = repeat % len(PHASES)
                for phase in PHASES[turn:] + PHASES[:turn]:
                    if phase == ALONE:
                        found = measure(mesh, target, ALONE, concurrency, seconds, repeat)
                        progress(found)
                        rounds.append(found)
                        continue
                    greedy = phase == GREEDY
                    out = Path(state) / f"batch-{repeat}-{int(greedy)}.parquet"
                    run = BatchRun(mesh, model, view, out, batch_size, greedy=greedy)
                    try:
                        wait_scoring(mesh, run)
                        rows_before, started = model_rows(mesh), time.monotonic()
                        found = measure(mesh, target, phase, concurrency, seconds, repeat)
                        overlapped = run.running()
                        answered = model_rows(mesh) - rows_before
                        elapsed = time.monotonic() - started
                    finally:
                        run.stop()
                    # Every online Predict is one row; the rest are the batch run's.
                    batch_rows = max(0.0, answered - found.rps * seconds)
                    windows.append(
                        BatchWindow(repeat, greedy, round(batch_rows / elapsed), overlapped)
                    )
                    progress(found)
                    rounds.append(found)
        finally:
            mesh.stop()
    rows = summarize_rows(rounds, set())
    by = {r.target: r for r in rows}
    alone = [r.p99_ms for r in rounds if r.target == ALONE]
    during = [r.p99_ms for r in rounds if r.target == DURING]
    greedy_p99 = [r.p99_ms for r in rounds if r.target == GREEDY]
    ratio = statistics.median(during) / statistics.median(alone)
    greedy_ratio = statistics.median(greedy_p99) / statistics.median(alone)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": model,
        "view": view,
        "entities": entities,
        "concurrency": concurrency,
        "seconds": seconds,
        "repeats": repeats,
        "batch_size": batch_size,
        "rows": [asdict(r) for r in rows],
        "batch_windows": [asdict(w) for w in windows],
        "p99_during_over_alone": {
            "median": round(ratio, 3),
            "per_repeat": [round(d / a, 3) for d, a in zip(during, alone, strict=False)],
            "spread_alone": round(spread(alone), 3),
            "spread_during": round(spread(during), 3),
        },
        "p50_during_over_alone": round(by[DURING].p50_ms_median / by[ALONE].p50_ms_median, 3),
        "p99_greedy_over_alone": {
            "median": round(greedy_ratio, 3),
            "per_repeat": [round(d / a, 3) for d, a in zip(greedy_p99, alone, strict=False)],
        },
        "goals": [
            {
                "goal": f"online p99 during a batch run / alone <= {GOAL_P99_RATIO}",
                "measured": round(ratio, 3),
                "met": ratio <= GOAL_P99_RATIO
                and all(w.overlapped for w in windows if not w.greedy),
            }
        ],
        "rounds": [asdict(r) for r in rounds],
    }


def round_line(found: Round) -> str:
    return (
        f"  {found.target} repeat {found.repeat}: {found.rps:,.0f} req/s, p99 {found.p99_ms:.1f} ms"
    )


def as_report(report: Mapping[str, object]) -> BenchReport:
    """The run for people: each phase's req/s and latency, the batch run's rows/s in each
    window, p99 during over alone, the goal."""
    shown = BenchReport(
        "servemesh bench batch --through-mesh",
        report,
        title=f"online Predicts at c={report['concurrency']} through the edge, "
        f"{report['repeats']} repeats of {report['seconds']} s, with and without `batch score "
        f"--through-mesh` of {report['entities']:,} {report['view']} entities (batch "
        f"{report['batch_size']})",
    )
    lines = [
        f"{'phase':<20} {'req/s':>7} {'min-max':>11} {'p50 ms':>7} {'p99 ms':>7} {'p99 max':>8}"
    ]
    for row in report["rows"]:  # type: ignore[attr-defined]
        lines.append(
            f"{row['target']:<20} {row['rps_median']:>7,.0f} "
            f"{row['rps_min']:>5,.0f}-{row['rps_max']:<5,.0f} {row['p50_ms_median']:>7.2f} "
            f"{row['p99_ms_median']:>7.2f} {row['p99_ms_max']:>8.2f}"
        )
    windows = report["batch_windows"]
    for greedy, name in ((False, "batch run"), (True, "greedy batch run")):
        listed = ", ".join(
            f"{w['rows_per_s']:,} rows/s{'' if w['overlapped'] else ' (ended early)'}"
            for w in windows  # type: ignore[attr-defined]
            if w["greedy"] == greedy
        )
        lines.append(f"{name} during each window: {listed}")
    shown.note("\n".join(lines))
    for name, key in (
        ("p99 during / alone", "p99_during_over_alone"),
        ("p99 during greedy / alone", "p99_greedy_over_alone"),
    ):
        ratio = report[key]
        assert isinstance(ratio, dict)
        shown.ratio(name, ratio["median"], ratio["per_repeat"], digits=None)
    shown.note(f"p50 during / alone: {report['p50_during_over_alone']}x")
    for goal in report["goals"]:  # type: ignore[attr-defined]
        shown.note(f"  {goal['goal']}: {goal['measured']} {'met' if goal['met'] else 'MISSED'}")
    return shown


def main(
    spec: str | None,
    *,
    rows: int | None,
    concurrency: int,
    seconds: float,
    repeats: int,
    batch_size: list[int] | None,
    quiet: bool = False,
) -> BenchReport:
    """`servemesh bench batch --through-mesh`: `rows` entities (default 400000), the first
    of `batch_size` (default 256); the spec file, else the built-in spec."""
    from servemesh.spec import load_spec

    return as_report(
        bench_during_batch(
            load_spec(spec) if spec else MeshSpec(),
            entities=rows or 400_000,
            concurrency=concurrency,
            seconds=seconds,
            repeats=repeats,
            batch_size=(batch_size or [256])[0],
            progress=progress(quiet, round_line),
        )
    )
