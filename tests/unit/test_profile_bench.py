"""`servemesh bench profile`: reading py-spy's stacks, and py-spy itself on a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from servemesh.bench.profile import (
    find_py_spy,
    merge_line,
    parse_collapsed,
    profiled_instances,
    record,
    top_inclusive,
    top_own_time,
)
from servemesh.spec import MeshSpec, Ports, resolve


class PerZoneMesh:
    """What profiled_instances reads of a running mesh: its spec and its processes."""

    def __init__(self) -> None:
        self.spec = resolve(MeshSpec(ports=Ports.free()))

    def pids(self) -> dict[str, int]:
        names = [i.name for i in self.spec.instances()]
        names += ["envoy", "envoy-zone-a", "envoy-zone-b", "redis", "tracestore"]
        return {name: 1000 + n for n, name in enumerate(names)}


def test_one_python_process_of_each_kind_is_profiled_and_no_envoy() -> None:
    chosen = profiled_instances(PerZoneMesh())  # type: ignore[arg-type]
    assert sorted(chosen) == ["feature", "gateway", "model", "tracestore"]
    assert chosen["gateway"][0].startswith("gateway-")


ENTRY = "<module> (services/gateway/__main__.py:9);run (asyncio/runners.py:190)"
PREDICT = "Predict (services/gateway/service.py"
RAW = "\n".join(
    [
        f"{ENTRY};Handle._run (asyncio/events.py:80) 50",
        f"{ENTRY};{PREDICT}:220);plan (services/gateway/predict.py:132) 20",
        f"{ENTRY};{PREDICT}:233);plan (services/gateway/predict.py:140) 10",
        f"{ENTRY};{PREDICT}:233) 15",
        "_worker (concurrent/futures/thread.py:83);write (servemesh/predlog/buffer.py:204) 5",
        "not a sample line",
    ]
)


def test_lines_of_one_function_count_as_one_frame() -> None:
    assert merge_line("Predict (services/gateway/service.py:233)") == (
        "Predict (services/gateway/service.py)"
    )
    assert merge_line("<native>") == "<native>"
    stacks = parse_collapsed(RAW)
    assert sum(stacks.values()) == 100  # the malformed line is skipped
    plan: tuple[str, ...] = ("<module> (services/gateway/__main__.py)", "run (asyncio/runners.py)")
    plan += ("Predict (services/gateway/service.py)", "plan (services/gateway/predict.py)")
    assert stacks[plan] == 30  # two lines of plan, under two lines of Predict


def test_own_time_is_the_top_of_the_stack() -> None:
    top = top_own_time(parse_collapsed(RAW), 3)
    assert [(s.frame, s.share) for s in top] == [
        ("Handle._run (asyncio/events.py)", 0.5),
        ("plan (services/gateway/predict.py)", 0.3),
        ("Predict (services/gateway/service.py)", 0.15),
    ]


def test_inclusive_time_of_the_mesh_s_own_code_leaves_out_start_up_frames() -> None:
    top = top_inclusive(parse_collapsed(RAW), 5)
    assert [(s.frame, round(s.share, 2)) for s in top] == [
        ("Predict (services/gateway/service.py)", 0.45),
        ("plan (services/gateway/predict.py)", 0.3),
        ("write (servemesh/predlog/buffer.py)", 0.05),
    ]
    everything = top_inclusive(parse_collapsed(RAW), 2, own_code_only=False)
    assert everything[0].frame == "run (asyncio/runners.py)"  # in 95 of 100 samples


SPINNER = """
import sys, time
def spin_in_a_known_frame():
    while True:
        sum(range(1000))
print("ready", flush=True)
spin_in_a_known_frame()
"""


def test_py_spy_finds_where_a_real_process_spends_its_time(tmp_path: Path) -> None:
    py_spy = find_py_spy()
    assert py_spy is not None, "py-spy comes with the test extra"
    script = tmp_path / "spinner.py"
    script.write_text(SPINNER)
    spinner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert spinner.stdout is not None and spinner.stdout.readline() == "ready\n"
        try:
            files = record(py_spy, {"spinner": spinner.pid}, 1.0, 200, tmp_path / "out")
        except RuntimeError as exc:
            if "ermission" in str(exc):
                pytest.skip(f"this machine does not let py-spy read another process: {exc}")
            raise
    finally:
        spinner.kill()
        spinner.wait()
        assert spinner.stdout is not None
        spinner.stdout.close()
    stacks = parse_collapsed(files["spinner"].read_text())
    assert sum(stacks.values()) > 50  # about 200 samples in a second
    top = top_own_time(stacks, 1)[0]
    assert top.frame.startswith("spin_in_a_known_frame (") and top.share > 0.5
