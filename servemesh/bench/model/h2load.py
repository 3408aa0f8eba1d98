"""Closed loops driven by h2load, nghttp2's load generator written in C (`bench model
--client h2load`).

The Python client costs about as much CPU per call as the server it drives, so at c=64 it
can be what limits a fast server. h2load sends one pre-built gRPC frame (the 5-byte prefix
and a serialised ModelInferRequest) over and over on `c` streams (for `bench model`, one
per connection), with the same 5 s deadline (`grpc-timeout`) the Python client sets. It
cannot read gRPC's status (a trailer), so a run's answers are checked on the server's side: the
servers' own counters (`ServerWindow`) give the outcomes of exactly the requests of the
measured window, and a target with none (echo) is probed once with the Python client before
the first run.

The measured window is h2load's own: it warms up for `warmup_s` and prints a line when its
main duration starts and another when it ends; the server's CPU time and counters are
read at those two lines, and rates are over the time between them, which can be shorter
than asked (h2load may end its warm-up late and still stop on time). Latencies come from
h2load's per-request log (`--log-file`: start time in µs since the epoch, HTTP status, µs
to the end of the answer), keeping the requests that started in the window.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from servemesh.bench.model.load import LoadResult, WindowHook
from servemesh.contract.errors import ServemeshError
from servemesh.contract.wire import MODEL_INFER_METHOD
from servemesh.observe.cpu import proc_cpu_seconds

H2LOAD = "h2load"
# Printed by h2load (one thread) when its main duration starts and ends.
MAIN_STARTED = "Main benchmark duration is started"
MAIN_OVER = "Main benchmark duration is over"


class H2loadUnavailable(ServemeshError, RuntimeError):
    """h2load is not installed, or did not run as expected; the message says which."""


def h2load_path() -> str:
    """Where h2load is; H2loadUnavailable with the install line when it is not."""
    found = shutil.which(H2LOAD)
    if found is None:
        raise H2loadUnavailable(
            "h2load is not installed (Debian/Ubuntu: apt-get install nghttp2-client)"
        )
    return found


def grpc_frame(body: bytes) -> bytes:
    """One gRPC message as it goes on the wire: uncompressed flag, length, bytes."""
    return b"\x00" + struct.pack(">I", len(body)) + body


def parse_requests(text: str) -> dict[str, int]:
    """h2load's "requests:" line as numbers (total, started, done, succeeded, failed,
    errored, timeout); H2loadUnavailable when the output has none."""
    for line in text.splitlines():
        if line.startswith("requests:"):
            counts: dict[str, int] = {}
            for part in line.removeprefix("requests:").split(","):
                number, _, name = part.strip().partition(" ")
                counts[name] = int(number)
            return counts
    raise H2loadUnavailable(f"h2load printed no requests line:\n{text[-2000:]}")


def read_latencies(log: Path, since_epoch_us: int) -> tuple[list[float], int]:
    """Latencies (ms) of the 2xx answers to requests started from `since_epoch_us` on, and
    how many such requests got another status."""
    latencies: list[float] = []
    other = 0
    for line in log.read_text().splitlines():
        start, status, duration = line.split("\t")[:3]
        if int(start) < since_epoch_us:
            continue
        if status.startswith("2"):
            latencies.append(int(duration) / 1000.0)
        else:
            other += 1
    return latencies, other


def closed_loop(
    address: str,
    frame_file: Path,
    concurrency: int,
    seconds: float,
    warmup_s: float = 1.0,
    timeout_s: float = 5.0,
    hook: WindowHook | None = None,
    *,
    method: str = MODEL_INFER_METHOD,
    tls: bool = False,
    connections: int | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> LoadResult:
    """`concurrency` streams, each sending the frame to `method` again as soon as its
    answer came; the result holds the window's requests (not yet checked against the
    server's counters: the caller does that), over the window's measured length.
    `connections`: the streams shared over that many connections (default: one stream on
    each of `concurrency` connections). `tls`: over TLS (h2 by ALPN); h2load checks no
    certificate and can present none, so only a listener that asks for no client
    certificate can be driven this way. `headers`: sent with every request; they go on
    h2load's command line, which other users of the host can read, so nothing long-lived."""
    with tempfile.TemporaryDirectory(prefix="servemesh-h2load-") as tmp:
        log = Path(tmp) / "requests.tsv"
        conns = connections or concurrency
        if concurrency % conns:
            raise ValueError(f"{concurrency} streams do not share evenly over {conns} connections")
        argv = [h2load_path(), "-t", "1", "-c", str(conns), "-m", str(concurrency // conns)]
        argv += ["-D", f"{round(seconds * 1000)}ms", f"--warm-up-time={round(warmup_s * 1000)}ms"]
        argv += ["-H", "content-type: application/grpc", "-H", "te: trailers"]
        argv += ["-H", f"grpc-timeout: {round(timeout_s * 1000)}m"]
        for name, value in headers:
            argv += ["-H", f"{name}: {value}"]
        argv += ["-d", str(frame_file), f"--log-file={log}"]
        argv += [f"{'https' if tls else 'http'}://{address}/{method.lstrip('/')}"]
        output: list[str] = []
        opened_at = closed_at = 0.0
        cpu_open = cpu_close = 0.0
        since_us = 0
        with subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process:
            assert process.stdout is not None
            for line in process.stdout:
                output.append(line)
                if line.startswith(MAIN_STARTED) and not opened_at:
                    if hook:
                        hook(True)
                    since_us = time.time_ns() // 1000
                    opened_at, cpu_open = time.perf_counter(), proc_cpu_seconds(process.pid) or 0.0
                elif line.startswith(MAIN_OVER) and opened_at and not closed_at:
                    closed_at, cpu_close = time.perf_counter(), proc_cpu_seconds(process.pid) or 0.0
                    if hook:
                        hook(False)
        text = "".join(output)
        if process.returncode != 0 or not closed_at:
            raise H2loadUnavailable(f"h2load exited {process.returncode}:\n{text[-2000:]}")
        counts = parse_requests(text)
        if not counts.get("done"):
            # h2load exits 0 having done nothing when it cannot connect.
            raise H2loadUnavailable(f"h2load completed no request to {address}:\n{text[-2000:]}")
        latencies, other_status = read_latencies(log, since_us)
    wall = closed_at - opened_at
    errors = {name: counts.get(name, 0) for name in ("errored", "timeout") if counts.get(name, 0)}
    if other_status:
        errors["http status not 2xx"] = other_status
    return LoadResult(
        mode="closed",
        concurrency=concurrency,
        # The window as it was, not as asked: h2load can end its warm-up late and keep the
        # end where -D put it (seen through a TLS edge: 0.3 s of a 0.6 s window).
        seconds=wall,
        sent=len(latencies) + other_status,
        ok=len(latencies),
        errors=errors,
        latencies_ms=latencies,
        client_cpu=(cpu_close - cpu_open) / wall if wall > 0 else 0.0,
    )
