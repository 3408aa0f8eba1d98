"""Where each Python service spends its time under load: `servemesh bench profile`.

Starts a mesh (free ports, no Prometheus, as `bench predict`), drives Predict through the
edge with a closed loop, and samples one process of every Python kind (gateway, feature,
model, trace store) with py-spy while the load runs. Prints each kind's top frames by own
time (the frame on top of the sampled stack, its line numbers merged), and its top frames
of the mesh's own code by inclusive time. py-spy's raw stacks (the collapsed format flame
graph tools read) are written beside the report.

What the samples are: the thread holding the GIL, so work done outside it (the forward
pass torch runs with the GIL released, gRPC's I/O threads) does not show. gRPC's Cython
layer has no Python frames of its own: its work shows as the asyncio frame that called it
(`Handle._run` for the server's and the client's callbacks, `UnaryUnaryCall._invoke` for
a client call). Envoy and Redis are not Python; `servemesh bench predict` gives their CPU
per Predict.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from servemesh.bench.observe import bench_credentials, process_kind, wait_answering
from servemesh.bench.predict import bench_spec
from servemesh.bench.report import BenchReport
from servemesh.identity import dial_every_edge
from servemesh.launcher import Mesh
from servemesh.load import ClosedLoop, LoadRun, closed_loop, predict_target, summarize
from servemesh.spec import MeshSpec, load_spec

# Kinds that are not Python processes: py-spy cannot read them.
NOT_PYTHON = frozenset({"envoy", "redis"})
# The mesh's own code, as py-spy names its files (relative to the import root).
OWN_CODE = ("services/", "servemesh/", "registry/", "chaos/")
# Where an event loop or a worker thread takes over from a process's start-up frames.
RUNTIME = ("asyncio/", "threading.py", "concurrent/")
WARMUP_S = 2.0
CALL_TIMEOUT_S = 5.0
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


# --- reading py-spy's raw output --------------------------------------------------------


def parse_collapsed(text: str) -> Counter[tuple[str, ...]]:
    """py-spy's raw format ("frame;frame;...;frame COUNT" a line, outermost first) as
    sample counts by stack. Blank and malformed lines are skipped."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stacks[tuple(merge_line(frame) for frame in stack.split(";"))] += int(count)
    return stacks


def merge_line(frame: str) -> str:
    """'f (path.py:12)' -> 'f (path.py)': a function's lines count as one frame."""
    found = _FRAME.match(frame)
    if found is None:
        return frame
    return f"{found['function']} ({found['file']})"


def is_own_code(frame: str) -> bool:
    found = _FRAME.match(frame)
    return found is not None and found["file"].startswith(OWN_CODE)


@dataclass(frozen=True)
class FrameShare:
    frame: str
    share: float  # of the process's samples


def top_own_time(stacks: Mapping[tuple[str, ...], int], n: int = 10) -> list[FrameShare]:
    """The `n` frames most often on top of the stack."""
    total = sum(stacks.values())
    own: Counter[str] = Counter()
    for stack, count in stacks.items():
        if stack:
            own[stack[-1]] += count
    return [FrameShare(frame, count / total) for frame, count in own.most_common(n)]


def top_inclusive(
    stacks: Mapping[tuple[str, ...], int], n: int = 10, *, own_code_only: bool = True
) -> list[FrameShare]:
    """The `n` frames most often anywhere in the stack above its entry point (a frame
    counted once a sample, however deep its recursion); with `own_code_only`, only the
    mesh's own frames."""
    total = sum(stacks.values())
    inclusive: Counter[str] = Counter()
    for stack, count in stacks.items():
        for frame in set(stack[_entry_depth(stack) :]):
            if not own_code_only or is_own_code(frame):
                inclusive[frame] += count
    return [FrameShare(frame, count / total) for frame, count in inclusive.most_common(n)]


def _entry_depth(stack: tuple[str, ...]) -> int:
    """How many frames at the root of `stack` only start the process (`<module>`, a
    service's main, up to the event loop's or the thread's first frame): under every
    sample of their thread, they would top an inclusive list and tell nothing."""
    for depth, frame in enumerate(stack):
        found = _FRAME.match(frame)
        if found is not None and found["file"].startswith(RUNTIME):
            return depth
    return 0


# --- sampling a running mesh ------------------------------------------------------------


def find_py_spy() -> str | None:
    """py-spy beside this interpreter (its venv), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def profiled_instances(mesh: Mesh) -> dict[str, tuple[str, int]]:
    """One running process of each Python kind: kind -> (instance, pid); the registry is
    left out (it answers nothing on the Predict path)."""
    chosen: dict[str, tuple[str, int]] = {}
    for name, pid in sorted(mesh.pids().items()):
        kind = process_kind(mesh.spec, name)
        # An Envoy per zone is named after its zone: envoy-zone-a.
        not_python = kind.split("-")[0] in NOT_PYTHON
        if not_python or kind == "registry" or kind in chosen:
            continue
        chosen[kind] = (name, pid)
    return chosen


def record(
    py_spy: str, pids: Mapping[str, int], seconds: float, rate_hz: int, out_dir: Path
) -> dict[str, Path]:
    """Sample every pid at once for `seconds`; kind -> its raw stacks file.

    py-spy stops a process for each sample it reads: read from a running process
    (--nonblocking), a quarter of the model server's samples showed a frame it had long
    left. Only the thread holding the GIL is sampled (--gil): without that, threads parked
    in native waits (the event loop's epoll, gRPC's completion-queue poller, a batch
    worker waiting for work) fill most of the samples of a process that is mostly busy.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    running: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for kind, pid in pids.items():
        path = out_dir / f"{kind}.collapsed.txt"
        argv = [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds)))]
        argv += ["--rate", str(rate_hz), "--format", "raw", "--output", str(path)]
        argv += ["--gil"]
        running[kind] = (
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
            path,
        )
    written: dict[str, Path] = {}
    for kind, (process, path) in running.items():
        _, err = process.communicate(timeout=seconds + 60)
        if process.returncode != 0 or not path.exists():
            message = err.decode(errors="replace").strip()[-400:]
            raise RuntimeError(f"py-spy failed on the {kind} process: {message}")
        written[kind] = path
    return written


@dataclass(frozen=True)
class KindProfile:
    kind: str
    instance: str
    samples: int
    top_own: list[FrameShare]
    top_own_code: list[FrameShare]
    raw: str  # the collapsed stacks file


def profile_kinds(
    files: Mapping[str, Path], instances: Mapping[str, tuple[str, int]], top: int
) -> list[KindProfile]:
    found = []
    for kind, path in sorted(files.items()):
        stacks = parse_collapsed(path.read_text())
        found.append(
            KindProfile(
                kind=kind,
                instance=instances[kind][0],
                samples=sum(stacks.values()),
                top_own=top_own_time(stacks, top),
                top_own_code=top_inclusive(stacks, top),
                raw=str(path),
            )
        )
    return found


def bench_profile(
    spec: MeshSpec,
    out_dir: Path,
    *,
    concurrency: int = 64,
    seconds: float = 8.0,
    rate_hz: int = 100,
    top: int = 10,
    py_spy: str,
) -> dict[str, object]:
    """Start a mesh, load it, sample its Python processes; the report as a JSON-able dict."""
    spec = bench_spec(spec)
    model = next(iter(sorted(spec.models)))
    with tempfile.TemporaryDirectory() as state:
        mesh = Mesh.from_spec(spec, Path(state))
        mesh.start()
        try:
            wait_answering(mesh)
            target = predict_target(
                dial_every_edge(mesh.spec),
                model=model,
                entities=max(1, spec.demo.entities),
                timeout_s=CALL_TIMEOUT_S,
                metadata=bench_credentials(mesh.spec),
            )
            instances = profiled_instances(mesh)
            # The load runs from before the samples start until after they end.
            loop = ClosedLoop(workers=concurrency, duration_s=WARMUP_S + seconds + 2.0)
            run = LoadRun()
            load = threading.Thread(
                target=lambda: asyncio.run(closed_loop(target, loop, run=run)),
                name="profile-load",
            )
            load.start()
            try:
                time.sleep(WARMUP_S)  # the callers' ramp-up: no event marks its end
                pids = {kind: pid for kind, (_, pid) in instances.items()}
                files = record(py_spy, pids, seconds, rate_hz, out_dir)
            finally:
                load.join()
            summary = summarize(run.window(WARMUP_S, WARMUP_S + seconds), seconds)
        finally:
            mesh.stop()
    kinds = profile_kinds(files, instances, top)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": model,
        "concurrency": concurrency,
        "seconds": seconds,
        "rate_hz": rate_hz,
        "rps": round(summary.ok / seconds, 1),
        "errors": summary.count - summary.ok,
        "kinds": [asdict(k) for k in kinds],
    }


def as_report(report: Mapping[str, object]) -> BenchReport:
    """The run for people: each kind's top frames, its own and the mesh's own code."""
    # Frames are long: a table cut to a narrow terminal would hide which one is meant.
    shown = BenchReport(
        "servemesh bench profile",
        report,
        title=f"c={report['concurrency']}, {report['seconds']} s sampled at {report['rate_hz']} "
        f"Hz; {report['rps']} Predicts/s, {report['errors']} errors",
        width=160,
    )
    for kind in report["kinds"]:  # type: ignore[attr-defined]
        table = shown.table(
            f"{kind['kind']} ({kind['instance']}, {kind['samples']} samples)",
            ("own time", "frame (top of stack)", "inclusive", "the mesh's own code"),
            left={"frame (top of stack)", "the mesh's own code"},
            title_justify="left",
        )
        own: list[dict[str, object]] = kind["top_own"]
        ours: list[dict[str, object]] = kind["top_own_code"]
        for i in range(max(len(own), len(ours))):
            left = own[i] if i < len(own) else None
            right = ours[i] if i < len(ours) else None
            table.add_row(
                f"{left['share']:.1%}" if left else "",
                str(left["frame"]) if left else "",
                f"{right['share']:.1%}" if right else "",
                str(right["frame"]) if right else "",
            )
        shown.note(f"raw stacks: {kind['raw']}")
    return shown


def main(
    spec: str | None,
    out: str | None,
    *,
    concurrency: int = 64,
    seconds: float = 8.0,
    rate: int = 100,
    top: int = 10,
) -> BenchReport:
    """`out`: where the raw stacks go (default a temp dir); `rate`: py-spy's samples/s."""
    py_spy = find_py_spy()
    if py_spy is None:
        raise SystemExit(
            "py-spy is not installed: pip install py-spy (it comes with the test extra)"
        )
    return as_report(
        bench_profile(
            load_spec(spec),
            Path(out) if out else Path(tempfile.mkdtemp(prefix="servemesh-profile-")),
            concurrency=concurrency,
            seconds=seconds,
            rate_hz=rate,
            top=top,
            py_spy=py_spy,
        )
    )
