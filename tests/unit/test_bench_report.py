"""The benchmarks' one tail (servemesh/bench/report.py): a report is printed for people, or
its payload as JSON, and written where --json-out says; and `servemesh bench` calls every
benchmark from its flags the same way (servemesh/cli/bench.py). No mesh, no network."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from servemesh.bench.report import BenchReport, Note, Ratio, Table, emit, progress
from servemesh.cli import build_parser
from servemesh.cli import main as cli_main
from servemesh.cli.bench import bench_arguments, bench_main

PAYLOAD = {"rows": [{"target": "edge", "rps": 812.5}], "ratio": {"median": 0.61}}


def _report() -> BenchReport:
    report = BenchReport("servemesh bench example", PAYLOAD, title="mesh start-up: 5.1 s")
    table = report.table("Predict (medians)", ("target", "req/s", "p99 ms"), left={"target"})
    table.add_row("edge", "812", "12.50")
    table.add_row("model alone", "2792", "37.15")
    report.ratio("edge / model alone at c=64", 0.6123, [0.45, 0.61, 0.63])
    report.note("errors: [UNAVAILABLE] 2")
    return report


def test_the_report_is_printed_for_people_and_its_payload_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    emit(_report(), json_stdout=False, json_out=out)
    assert json.loads(out.read_text()) == PAYLOAD
    assert out.read_text().endswith("}\n")
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0] == "mesh start-up: 5.1 s"
    assert "Predict (medians)" in printed
    row = next(line for line in lines if "model alone" in line and "2792" in line)
    assert "37.15" in row
    assert "edge / model alone at c=64: 0.61x (per repeat 0.45, 0.61, 0.63)" in lines
    # A note is printed as it is: brackets are not read as markup.
    assert lines[-1] == "errors: [UNAVAILABLE] 2"
    assert "{" not in printed


def test_json_on_stdout_is_the_payload_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    emit(_report(), json_stdout=True, json_out=None)
    printed = capsys.readouterr().out
    assert json.loads(printed) == PAYLOAD
    assert "Predict (medians)" not in printed
    assert not list(tmp_path.iterdir())


def test_the_console_given_is_the_one_printed_on() -> None:
    buffer = io.StringIO()
    emit(_report(), json_stdout=False, json_out=None, console=Console(file=buffer, width=100))
    assert "│ model alone │  2792 │  37.15 │" in buffer.getvalue()
    buffer = io.StringIO()
    emit(_report(), json_stdout=True, json_out=None, console=Console(file=buffer))
    assert json.loads(buffer.getvalue()) == PAYLOAD


def test_long_lines_stay_whole_and_markup_only_where_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = BenchReport("servemesh bench example", {})
    long = "idle mesh: " + ", ".join(f"kind{n} {n}.5" for n in range(40))
    report.note(long)
    report.note("[yellow]triton: skipped[/yellow]: no venv", markup=True)
    report.note("[yellow]as it is[/yellow]")
    emit(report, json_stdout=False, json_out=None)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [long, "triton: skipped: no venv", "[yellow]as it is[/yellow]"]


def test_the_report_keeps_its_parts_in_order_and_by_kind() -> None:
    report = _report()
    assert [type(b) for b in report.body] == [Table, Ratio, Note]
    assert [t.title for t in report.tables] == ["Predict (medians)"]
    assert report.ratios[0].spread == pytest.approx((0.63 - 0.45) / 0.6123)
    assert report.notes == [Note("errors: [UNAVAILABLE] 2")]
    assert report.status == 0


def test_a_ratio_prints_rounded_or_as_measured() -> None:
    assert Ratio("req/s on / off", 1.1666, [1.13, 1.531]).line() == (
        "req/s on / off: 1.17x (per repeat 1.13, 1.53)"
    )
    assert Ratio("p99 during / alone", 1.582, [1.918, 1.539], digits=None).line() == (
        "p99 during / alone: 1.582x (per repeat [1.918, 1.539])"
    )
    assert Ratio("none", 0.0, []).spread is None


def test_progress_is_quiet_when_the_report_goes_out_as_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    progress(False, lambda n: f"  round {n}")(1)
    progress(True, lambda n: f"  round {n}")(2)
    assert capsys.readouterr().out == "  round 1\n"


# Every way `servemesh bench` runs a benchmark: the subcommand, and a flag that picks another.
RUNS = [
    (["predict"], "servemesh.bench.predict"),
    (["predict", "--tiers"], "servemesh.bench.tiers"),
    (["observe"], "servemesh.bench.observe"),
    (["profile"], "servemesh.bench.profile"),
    (["model"], "servemesh.bench.model.run"),
    (["pool"], "servemesh.bench.model.pool"),
    (["stream"], "servemesh.bench.stream"),
    (["batch"], "servemesh.bench.batch"),
    (["batch", "--through-mesh"], "servemesh.bench.batch_mesh"),
    (["scale"], "servemesh.bench.scale"),
    (["layout"], "servemesh.bench.layout"),
]


@pytest.mark.parametrize(("argv", "module"), RUNS, ids=[" ".join(a) for a, _ in RUNS])
def test_every_parameter_of_a_benchmark_comes_from_a_flag_of_its_command(
    argv: list[str], module: str
) -> None:
    args = build_parser().parse_args(["bench", *argv, "--json"])
    main = bench_main(args)
    assert main.__module__ == module
    called = bench_arguments(args, main)  # a parameter no flag names: KeyError
    for name, value in called.items():
        assert value == (True if name == "quiet" else getattr(args, name))


def test_the_flags_reach_the_benchmark_by_name() -> None:
    args = build_parser().parse_args(
        ["bench", "scale", "--min", "2", "--max", "5", "--slo", "250ms", "--duration", "1m"]
    )
    called = bench_arguments(args, bench_main(args))
    assert called["min_replicas"] == 2 and called["max_replicas"] == 5
    assert called["slo_ms"] == 250.0 and called["seconds"] == 60.0
    assert called["quiet"] is False


def test_the_command_emits_what_the_benchmark_returns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: dict[str, Any] = {}

    def main(*, models: int, fit: int, concurrency: int, seconds: float, repeats: int) -> Any:
        asked.update(models=models, fit=fit)
        return BenchReport("servemesh bench pool", {"mixes": []}, title="pool", status=1)

    monkeypatch.setattr("servemesh.cli.bench.bench_main", lambda args: main)
    out = tmp_path / "pool.json"
    code = cli_main(["bench", "pool", "--models", "7", "--json", "--json-out", str(out)])
    assert code == 1 and asked == {"models": 7, "fit": 5}
    assert json.loads(capsys.readouterr().out) == {"mixes": []}
    assert json.loads(out.read_text()) == {"mixes": []}
