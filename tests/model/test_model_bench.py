"""`servemesh bench model`'s parts, briefly: load generators against an in-process echo
server, the target checks, the command line. (The benchmark itself is not a timed test.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from servemesh.bench.model.load import closed_loop, open_loop, request_bodies
from servemesh.bench.model.models import BENCH_MODELS
from servemesh.bench.model.run import (
    NICED,
    BenchConfig,
    ServerProcess,
    TargetUnavailable,
    aggregate,
    checks,
    nice_checks,
    sandbox_checks,
    variant_rows,
)
from servemesh.cli import build_parser
from servemesh.load import percentile
from servemesh.services.model.artifacts import open_artifact
from servemesh_api.inference import grpc_service_pb2 as oip


def test_request_bodies_are_valid_serialised_infer_requests() -> None:
    bodies = request_bodies("fraud", count=4, rows=2)
    request = oip.ModelInferRequest.FromString(bodies[3])
    assert request.model_name == "fraud" and list(request.inputs[0].shape) == [2, 64]
    assert len(request.raw_input_contents[0]) == 2 * 64 * 4
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0


async def test_closed_and_open_loops_count_answers_and_windows(echo_address: str) -> None:
    bodies = request_bodies("fraud", count=8)
    windows: list[bool] = []
    closed = await closed_loop(echo_address, bodies, 4, 0.3, warmup_s=0.1, hook=windows.append)
    assert windows == [True, False]
    assert closed.ok > 10 and not closed.errors and closed.sent == closed.ok
    summary = closed.summary()
    assert isinstance(summary["p50_ms"], float) and isinstance(summary["p99_ms"], float)
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    opened = await open_loop(echo_address, bodies, rate=200, seconds=0.5, warmup_s=0.1)
    assert 95 <= opened.sent <= 101 and opened.ok == opened.sent  # 200/s for 0.5 s
    assert opened.rps == pytest.approx(opened.ok / 0.5)


async def test_deadline_mix_marks_its_short_callers(echo_address: str) -> None:
    bodies = request_bodies("fraud", count=8)
    mix = await open_loop(
        echo_address,
        bodies,
        rate=200,
        seconds=0.5,
        warmup_s=0.05,
        # The short deadline is still generous: this checks the marking, and a box with a
        # busy core can hold an echo call past 20 ms. Whether short callers meet a tight
        # deadline is what the benchmark itself measures.
        timeout_for=lambda i: 5.0 if i % 10 < 3 else 10.0,
        is_short=lambda i: i % 10 < 3,
    )
    assert mix.mode == "deadline-mix"
    assert mix.short_sent == pytest.approx(0.3 * mix.sent, abs=2)
    assert mix.errors == {}
    assert mix.short_ok == mix.short_sent


async def test_an_unreachable_server_is_counted_as_errors() -> None:
    result = await closed_loop("127.0.0.1:1", request_bodies("fraud", 2), 1, 0.2, 0.0, 0.05)
    assert result.ok == 0 and set(result.errors) == {grpc.StatusCode.UNAVAILABLE.name}


def test_checks_compare_with_the_issue_targets() -> None:
    def row(target: str, mode: str, concurrency: int = 0, **values: float) -> dict[str, object]:
        base = {"target": target, "mode": mode, "concurrency": concurrency, "expired_computed": 0}
        return {**base, "rps": 0.0, "p50_ms": 0.0, "p99_ms": 0.0, **values}

    report = {
        "rows": [
            row("servemesh adaptive", "closed", 1, rps=900, p50_ms=1.1, p99_ms=2.0),
            row("servemesh adaptive", "closed", 16, rps=2800, p50_ms=5, p99_ms=9),
            row("servemesh adaptive", "closed", 64, rps=2700, p50_ms=23, p99_ms=30),
            row("batching off", "closed", 64, rps=1200),
            row("echo (protocol ceiling)", "closed", 64, rps=3000),
            row("triton (pytriton)", "closed", 64, rps=1500, p99_ms=52),
            row("adaptive, slow model", "deadline-mix", rps=1800),
            row("fixed window, slow model", "deadline-mix", rps=1400, expired_computed=200),
            row("servemesh adaptive", "deadline-mix", rps=1900),
            row("fixed window", "deadline-mix", rps=2000, expired_computed=300),
        ]
    }
    found = {c["target"]: (c["value"], c["met"]) for c in checks(report)}
    assert found["c=64 req/s vs Triton, same run (x)"] == (1.8, True)
    assert found["c=64 p99 vs Triton's (ms)"] == (30, True)
    assert found["c=64 req/s vs c=16 (x, no fall)"] == (0.96, False)
    assert found["c=64 req/s vs batching off (x)"] == (2.25, False)
    assert found["c=64 req/s vs the echo ceiling (x)"] == (0.9, True)
    assert found["c=1 p50 (ms)"] == (1.1, True)
    assert found["model-bound mix: goodput vs fixed window (x)"] == (1.29, True)
    assert found["model-bound mix: expired requests computed"] == (0, True)
    assert found["protocol-bound mix: goodput vs fixed window (x)"] == (0.95, False)


def test_a_skipped_peer_is_reported_as_skipped_not_compared() -> None:
    adaptive = {"target": "servemesh adaptive", "mode": "closed", "concurrency": 64}
    report = {
        "rows": [{**adaptive, "rps": 2000.0, "p50_ms": 20.0, "p99_ms": 30.0}],
        "skipped": {"triton (pytriton)": ".venv-pytriton/bin/python is missing"},
    }
    found = {c["target"]: (c["value"], c["met"]) for c in checks(report)}
    assert found["c=64 req/s vs Triton, same run (x)"] == ("skipped", None)


def test_a_row_is_the_median_of_its_repeats_with_min_max_and_spread() -> None:
    def sample(rps: float, p99: float, errors: dict[str, int]) -> dict[str, object]:
        return {
            **{"target": "t", "mode": "closed", "concurrency": 64, "rps": rps, "ok": 10},
            **{"p99_ms": p99, "errors": errors, "error_count": sum(errors.values())},
            **{"mean_batch": None, "outcomes": {"ok": 10}},
        }

    row = aggregate(
        [sample(900, 30, {}), sample(1000, 10, {"UNAVAILABLE": 2}), sample(1300, 20, {})]
    )
    assert row["rps"] == 1000 and row["p99_ms"] == 20  # each field's own median
    assert row["concurrency"] == 64 and isinstance(row["concurrency"], int)
    assert (row["rps_min"], row["rps_max"], row["runs"]) == (900, 1300, [900, 1000, 1300])
    assert row["spread"] == 0.4  # (1300 - 900) / 1000: beyond 25%, the bench re-runs it
    assert row["ok"] == 30 and row["errors"] == {"UNAVAILABLE": 2} and row["error_count"] == 2
    assert row["outcomes"] == {"ok": 30} and row["mean_batch"] is None and row["repeats"] == 3


def test_triton_is_skipped_with_the_reason_where_pytriton_is_missing(tmp_path: Path) -> None:
    config = BenchConfig(against=("triton",), pytriton_python=tmp_path / "none" / "python")
    triton = [t for t in config.targets() if t.kind == "triton"]
    assert [t.name for t in triton] == ["triton (pytriton)"]
    with pytest.raises(TargetUnavailable, match="make pytriton-venv"):
        ServerProcess(triton[0], config, tmp_path)


def test_bench_model_command_line() -> None:
    args = build_parser().parse_args(["bench", "model", "--quick", "--rate", "900"])
    assert args.quick and args.rate == 900 and args.server_cpu == 0 and args.client_cpu == 1
    assert args.repeats == 3 and args.against == [] and not args.json
    args = build_parser().parse_args(["bench", "model", "--against", "triton", "--json"])
    assert args.against == ["triton"] and args.json
    names = [t.name for t in BenchConfig().targets()]
    assert names[:4] == [
        "servemesh adaptive",
        "fixed window",
        "batching off",
        "echo (protocol ceiling)",
    ]
    fixed = BenchConfig().targets()[1].batching
    assert fixed["dispatch"] == "fixed_window" and fixed["deadline_policy"] == "ignore"


def test_the_heavy_model_is_a_checked_export_that_computes_what_its_network_does() -> None:
    import torch

    from servemesh.contract.demo import build_heavy_model

    artifact = BENCH_MODELS["heavy"].artifact(1)
    opened = open_artifact(artifact.data)  # the pt2 guard's allowlist first, as served
    assert opened.format == "torch_export" == artifact.format
    assert opened.signature is not None
    [features] = opened.signature.inputs
    [score] = opened.signature.outputs
    assert (features.name, features.datatype, features.shape) == ("features", "FP32", (-1, 64))
    assert (score.datatype, score.shape) == ("FP32", (-1, 1))
    rows = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.allclose(opened.module(rows), build_heavy_model(1)(rows), atol=1e-6)


def test_the_heavy_bench_measures_closed_loops_of_the_batching_targets() -> None:
    config = BenchConfig(model="heavy", against=("triton",))
    found = {t.name: t.scenarios for t in config.targets()}
    assert found == {
        "servemesh adaptive": ("closed",),
        "fixed window": ("closed",),
        "batching off": ("closed",),
        "echo (protocol ceiling)": ("closed",),
        "adaptive, inference niced": ("closed",),
        "adaptive, no sandbox": ("closed",),
        "servemesh adaptive, INT8": ("closed",),
        "triton (pytriton)": ("closed",),
    }
    assert {t.name: t.variant for t in config.targets()}["servemesh adaptive, INT8"] == "int8"
    # Only the row that measures what the sandbox costs serves without it.
    assert [t.name for t in config.targets() if not t.sandbox] == ["adaptive, no sandbox"]
    assert not [t for t in BenchConfig().targets() if t.variant], "the demo run has no INT8"


def test_heavy_checks_compare_with_triton_at_16_and_64() -> None:
    def row(target: str, concurrency: int, rps: float) -> dict[str, object]:
        return {"target": target, "mode": "closed", "concurrency": concurrency, "rps": rps}

    report = {
        "config": {"model": "heavy"},
        "rows": [
            row("servemesh adaptive", 16, 1100),
            row("servemesh adaptive", 64, 1500),
            row("triton (pytriton)", 16, 1000),
            row("triton (pytriton)", 64, 1600),
            row("batching off", 64, 600),
        ],
    }
    found = {c["target"]: (c["value"], c["met"]) for c in checks(report)}
    assert found == {
        "heavy c=16 req/s vs Triton, same run (x)": (1.1, True),
        "heavy c=64 req/s vs Triton, same run (x)": (0.94, False),
        "heavy c=64 req/s vs batching off (x)": (2.5, True),
    }


def test_fp32_and_int8_rows_are_set_side_by_side_from_one_run() -> None:
    def row(target: str, concurrency: int, rps: float, p99: float) -> dict[str, object]:
        return {
            "target": target,
            "mode": "closed",
            "concurrency": concurrency,
            "rps": rps,
            "p99_ms": p99,
            "mean_batch": 8.0,
        }

    report: dict[str, Any] = {
        "rows": [
            row("servemesh adaptive", 1, 500, 3.0),
            row("servemesh adaptive", 64, 1000, 90.0),
            row("servemesh adaptive, INT8", 1, 600, 2.5),
            row("servemesh adaptive, INT8", 64, 2500, 40.0),
        ],
        "servers": {
            "servemesh adaptive": {"artifact_bytes": 17 << 20, "rss_bytes": 400 << 20},
            "servemesh adaptive, INT8": {"artifact_bytes": 4 << 20, "rss_bytes": 350 << 20},
        },
    }
    found = variant_rows(report)
    assert found is not None
    assert [(r["concurrency"], r["ratio"], r["int8_p99_ms"]) for r in found["loads"]] == [
        (1, 1.2, 2.5),
        (64, 2.5, 40.0),
    ]
    assert found["sizes"]["int8_artifact_bytes"] == 4 << 20
    assert variant_rows({"rows": report["rows"][:2]}) is None


def test_the_int8_variant_of_the_heavy_model_is_quantized_and_close() -> None:
    import numpy as np
    import torch

    heavy = BENCH_MODELS["heavy"]
    fp32, int8 = heavy.artifact(1), heavy.artifact(1, "int8")
    assert int8.format == "torchscript" and int8.size < fp32.size / 3
    rows = torch.from_numpy(np.random.default_rng(3).normal(size=(4, 64)).astype(np.float32))
    with torch.inference_mode():
        want = open_artifact(fp32.data).module(rows)
        got = open_artifact(int8.data).module(rows)
    assert torch.allclose(got, want, atol=0.05)
    with pytest.raises(ValueError, match="variant"):
        heavy.artifact(1, "int4")


def test_bench_model_and_predict_take_the_heavy_model() -> None:
    args = build_parser().parse_args(["bench", "model", "--model", "heavy"])
    assert args.model == "heavy"
    assert build_parser().parse_args(["bench", "model"]).model == "demo"
    args = build_parser().parse_args(["bench", "predict", "--model", "heavy"])
    assert args.model == "heavy"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "model", "--model", "huge"])


def test_every_model_server_of_a_run_loads_one_artifact_built_by_the_run(tmp_path: Path) -> None:
    from servemesh.bench.model.run import _artifact_file
    from servemesh.bench.model.targets import read_artifact

    config = BenchConfig(model="demo")
    path = _artifact_file(config, "", tmp_path)
    assert read_artifact(path) == BENCH_MODELS["demo"].artifact(1)
    path.write_bytes(b"kept")  # built once: a second server of the run reads the same file
    assert _artifact_file(config, "", tmp_path).read_bytes() == b"kept"
    int8 = read_artifact(_artifact_file(config, "int8", tmp_path))
    assert int8.format == "torchscript" and int8 == BENCH_MODELS["demo"].artifact(1, "int8")


def test_the_in_process_ceiling_runs_the_batcher_enforcing_deadlines_and_blind() -> None:
    from servemesh.bench.model.targets import ceiling

    found = ceiling(0.3, 8, BENCH_MODELS["demo"])
    assert set(found) == {"forward_b1", "forward_b8", "batcher_c64", "batcher_c64_ignore"}
    assert found["batcher_c64"]["deadline_policy"] == "enforce"
    assert found["batcher_c64_ignore"]["deadline_policy"] == "ignore"
    for key in ("batcher_c64", "batcher_c64_ignore"):
        # 64 callers and batches of at most 8: every batch the batcher formed was full.
        assert found[key]["req_per_s"] > 0 and found[key]["mean_batch"] == 8.0


def test_the_niced_model_thread_is_compared_with_the_default_in_the_same_run() -> None:
    niced = [t for t in BenchConfig().targets() if t.name == NICED]
    assert [t.batching["inference_nice"] for t in niced] == [10]
    assert niced[0].scenarios == ("closed", "mix")

    def row(target: str, c: int, rps: float, p99: float) -> dict[str, object]:
        return {"target": target, "mode": "closed", "concurrency": c, "rps": rps, "p99_ms": p99}

    found = {
        c["target"]: (c["value"], c["met"])
        for c in nice_checks(
            [
                row("servemesh adaptive", 64, 1500.0, 80.0),
                row(NICED, 64, 1860.0, 120.0),
                row("servemesh adaptive", 1, 540.0, 2.7),
                row(NICED, 1, 580.0, 2.5),
            ]
        )
    }
    assert found == {
        "c=64 req/s, inference niced vs default (x)": (1.24, True),
        "c=64 p99, inference niced vs default (x)": (1.5, False),
        "c=1 req/s, inference niced vs default (x)": (1.07, True),
    }


def test_sandbox_checks_compare_the_confined_server_with_the_bare_one() -> None:
    def row(target: str, concurrency: int, rps: float, p50: float) -> dict[str, object]:
        return {
            "target": target,
            "mode": "closed",
            "concurrency": concurrency,
            "rps": rps,
            "p50_ms": p50,
        }

    rows = [
        row("servemesh adaptive", 64, 960.0, 40.0),
        row("adaptive, no sandbox", 64, 1000.0, 39.0),
        row("servemesh adaptive", 1, 400.0, 2.4),
        row("adaptive, no sandbox", 1, 410.0, 2.1),
    ]
    found = {c["target"]: (c["value"], c["met"]) for c in sandbox_checks(rows)}
    assert found == {
        "c=64 req/s, sandbox vs none (x)": (0.96, True),
        "c=1 p50 added by the sandbox (ms)": (0.3, False),
    }
