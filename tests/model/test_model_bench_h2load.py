"""`servemesh bench model --client h2load`: a real h2load (nghttp2's C client) against a real
echo server, how its output is read, and how a run's answers are checked on the server's
side (h2load cannot read gRPC's status). The benchmark itself is not a timed test."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from servemesh.bench.model import h2load
from servemesh.bench.model.load import request_bodies
from servemesh.bench.model.run import (
    BenchConfig,
    ServerWindow,
    TargetUnavailable,
    _count_server_errors,
    bench_model,
    checks,
    measurements,
    probe,
)
from servemesh.cli import build_parser

needs_h2load = pytest.mark.skipif(
    shutil.which("h2load") is None,
    reason="h2load is not installed (apt-get install nghttp2-client; .ci/run installs it)",
)


@needs_h2load
async def test_an_h2load_closed_loop_answers_in_its_window_with_latencies(
    echo_address: str, tmp_path: Path
) -> None:
    frame = tmp_path / "request.frame"
    frame.write_bytes(h2load.grpc_frame(request_bodies("fraud", count=1)[0]))
    windows: list[bool] = []
    # h2load blocks while it runs; the echo server answers on this test's event loop.
    result = await asyncio.to_thread(
        h2load.closed_loop, echo_address, frame, 4, 0.4, 0.2, hook=windows.append
    )
    assert windows == [True, False]
    assert result.ok > 10 and result.sent == result.ok and not result.errors
    summary = result.summary()
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]  # type: ignore[operator]
    assert result.concurrency == 4
    # Rates are over the window as h2load ran it (its two lines), never longer than asked
    # by more than the time to read a line.
    assert 0 < result.seconds < 0.4 + 0.25
    assert result.rps == pytest.approx(result.ok / result.seconds)


@needs_h2load
async def test_streams_can_share_fewer_connections(echo_address: str, tmp_path: Path) -> None:
    frame = tmp_path / "request.frame"
    frame.write_bytes(h2load.grpc_frame(request_bodies("fraud", count=1)[0]))
    result = await asyncio.to_thread(
        h2load.closed_loop, echo_address, frame, 8, 0.4, 0.2, connections=2
    )
    assert result.ok > 10 and not result.errors and result.concurrency == 8
    with pytest.raises(ValueError, match="8 streams do not share evenly over 3"):
        h2load.closed_loop(echo_address, frame, 8, 0.4, 0.2, connections=3)


@needs_h2load
async def test_h2load_that_cannot_connect_is_an_error_not_a_zero_row(tmp_path: Path) -> None:
    frame = tmp_path / "request.frame"
    frame.write_bytes(h2load.grpc_frame(b""))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]  # bound, never listening: connections refused
        with pytest.raises(h2load.H2loadUnavailable):
            await asyncio.to_thread(
                h2load.closed_loop, f"127.0.0.1:{closed_port}", frame, 2, 0.2, 0.1
            )


def test_a_grpc_frame_is_the_flag_the_length_and_the_message() -> None:
    assert h2load.grpc_frame(b"abc") == b"\x00\x00\x00\x00\x03abc"


def test_h2load_output_and_request_log_are_read() -> None:
    text = (
        "finished in 4.00s, 3129.00 req/s, 518.25KB/s\n"
        "requests: 9387 total, 9390 started, 9387 done, 9380 succeeded, 7 failed, "
        "0 errored, 0 timeout\n"
    )
    counts = h2load.parse_requests(text)
    assert counts["total"] == 9387 and counts["succeeded"] == 9380 and counts["failed"] == 7
    with pytest.raises(h2load.H2loadUnavailable):
        h2load.parse_requests("connect: Connection refused\n")


def test_the_request_log_keeps_the_windows_requests(tmp_path: Path) -> None:
    log = tmp_path / "requests.tsv"
    log.write_text("100\t200\t1500\n199\t200\t900\n200\t200\t2500\n300\t503\t100\n400\t200\t500\n")
    latencies, other = h2load.read_latencies(log, since_epoch_us=200)
    assert latencies == [2.5, 0.5] and other == 1


def _window(delta: dict[str, float]) -> ServerWindow:
    window = ServerWindow.__new__(ServerWindow)
    window.delta = delta
    return window


def test_server_counted_failures_are_errors_and_cancellations_at_the_stop_are_apart() -> None:
    row: dict[str, Any] = {
        "errors": {},
        "error_count": 0,
        "outcomes": {"ok": 900, "cancelled": 3, "expired": 2, "shed": 0},
    }
    _count_server_errors(row, _window({}))
    assert row["errors"] == {"server: expired": 2}
    assert row["error_count"] == 2 and row["cancelled_at_stop"] == 3
    triton: dict[str, Any] = {"errors": {}, "error_count": 0, "outcomes": {}}
    _count_server_errors(
        triton,
        _window(
            {
                "nv_inference_request_failure_total|reason=CANCELED": 4.0,
                "nv_inference_request_failure_total|reason=BACKEND": 1.0,
                "nv_inference_request_success_total": 800.0,
            }
        ),
    )
    assert triton["errors"] == {"server: nv_inference_request_failure_total|reason=BACKEND": 1}
    assert triton["cancelled_at_stop"] == 4


def test_a_target_that_does_not_answer_the_request_is_not_measured() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(TargetUnavailable, match="UNAVAILABLE"):
            probe(address, request_bodies("fraud", count=1)[0])
        assert time.monotonic() - started < 30


def test_with_h2load_every_target_runs_closed_loops_only() -> None:
    config = BenchConfig(client="h2load")
    for target in config.targets():
        modes = {m.mode for m in measurements(config, target)}
        assert modes == {"closed"}, target.name
    python = BenchConfig()
    assert {m.mode for t in python.targets() for m in measurements(python, t)} == {
        "closed",
        "open",
        "deadline-mix",
    }


def test_with_h2load_the_triton_goal_is_issue_26s() -> None:
    rows = [
        {"target": "servemesh adaptive", "mode": "closed", "concurrency": 64, "rps": 2800.0,
         "p50_ms": 20.0, "p99_ms": 27.0},
        {"target": "triton (pytriton)", "mode": "closed", "concurrency": 64, "rps": 3000.0,
         "p50_ms": 20.0, "p99_ms": 39.0},
    ]  # fmt: skip
    found = {c["target"]: (c["value"], c["goal"], c["met"]) for c in checks({
        "rows": rows, "config": {"model": "demo", "client": "h2load"}})}  # fmt: skip
    assert found["c=64 req/s vs Triton, same run, h2load (x)"] == (0.93, ">= 1.0", False)
    python = {c["target"]: c["goal"] for c in checks({"rows": rows, "config": {"model": "demo"}})}
    assert python["c=64 req/s vs Triton, same run (x)"] == ">= 1.5"


def test_bench_model_takes_the_client() -> None:
    assert build_parser().parse_args(["bench", "model"]).client == "python"
    args = build_parser().parse_args(["bench", "model", "--client", "h2load"])
    assert args.client == "h2load"


def test_without_h2load_the_run_stops_at_once_with_the_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "")
    said: list[str] = []
    with pytest.raises(h2load.H2loadUnavailable, match="apt-get install nghttp2-client"):
        bench_model(BenchConfig(client="h2load", client_cpu=None), say=said.append)
    assert said == []  # nothing started, not even the in-process ceiling
