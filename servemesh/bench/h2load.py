"""`servemesh bench predict --client h2load`: the rows of `bench predict`, each driven by
h2load (nghttp2's C client, `model_bench.h2load`) instead of the Python client.

Why: the Python client costs about as much CPU per call as a Python server, and `bench
predict` runs it on the same cores as the mesh it measures, so at c=64 the client takes
CPU the mesh would have used. h2load needs an eighth of that.

What h2load cannot do, and what stands in for it:

- It cannot read gRPC's status (a trailer). The edge's outcomes come from the edge Envoy's
  access log: every Predict whose start falls in the measured window, by grpc-status. The
  log is written in batches; after h2load exits, one more Predict (the marker) is sent and
  the log is read once the marker's line is in it, so every line of the window is too
  (Envoy appends lines in the order calls end). Envoy's admin `/reopen_logs` makes it
  write what it holds at once. The model server's outcomes come from its
  own counters (`model_bench.run.ServerWindow`), and the echo server, which cannot fail,
  is probed once.
- It cannot present a client certificate, and the mesh's model replicas take mutual TLS
  only. The model-alone row is therefore the standalone model server of `bench model`
  (`model_bench.targets model`): the same artifact and batching, plaintext, not pinned.
  Without TLS it does less work per call than a replica does, so the edge / model-alone
  ratio errs against the mesh, never for it.
- It sends one pre-built request: every edge call asks for the same entity. The bench's
  spec turns a model's tiers off, so no call is answered from a cache.

The `c` streams of a row share `connections` connections (bench predict's default: one,
the shape of one gRPC channel, which the Python client uses too). Over 64 connections of
one stream each the mesh spent about a quarter more CPU per Predict (docs/benchmarks.md).

Streams still open when h2load's duration ends are reset by it (at most one per stream
in flight); they are counted apart (`cancelled_at_stop`), not as errors.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc

from servemesh.bench.model import h2load
from servemesh.bench.model.load import LoadResult, WindowHook
from servemesh.bench.model.run import ServerProcess, ServerWindow
from servemesh.contract.wire import GATEWAY_SERVICE, MODEL_INFER_METHOD
from servemesh.identity import Dial
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

PREDICT_METHOD = f"/{GATEWAY_SERVICE}/Predict"
# gRPC status numbers by name, for the access log's grpc_status.
STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
# How long the edge's access log may take to show the marker's line.
LOG_WAIT_S = 15.0
LOG_POLL_S = 0.05


@dataclass(frozen=True)
class Measured:
    """One h2load closed loop's window: its answers, latencies and outcomes, and the CPU
    spent in it by process kind (the client's own apart)."""

    ok: int
    seconds: float
    latencies_ms: list[float]
    errors: dict[str, int]
    cancelled_at_stop: int
    cpu_seconds: dict[str, float]
    client_cpu_seconds: float
    # What h2load itself saw fail (connections, timeouts, HTTP statuses): kept apart, as
    # the server side's count already holds any call that reached it.
    client_errors: dict[str, int] = field(default_factory=dict)


@dataclass
class CpuWindow:
    """h2load's window hook: the wall clock (µs since the epoch, to compare with the access
    log's start times) and CPU by kind at its edges, then the caller's own hook."""

    read_cpu: Callable[[], Mapping[str, float]]
    also: WindowHook | None = None
    opened_us: int = 0
    closed_us: int = 0
    before: dict[str, float] = field(default_factory=dict)
    spent: dict[str, float] = field(default_factory=dict)

    def __call__(self, opening: bool) -> None:
        if opening:
            self.opened_us = time.time_ns() // 1000
            self.before = dict(self.read_cpu())
        else:
            self.closed_us = time.time_ns() // 1000
            after = self.read_cpu()
            self.spent = {k: v - self.before.get(k, v) for k, v in sorted(after.items())}
        if self.also is not None:
            self.also(opening)

    @property
    def seconds(self) -> float:
        return (self.closed_us - self.opened_us) / 1e6


def frame_file(directory: Path, name: str, body: bytes) -> Path:
    """`body` as one gRPC frame in a file of `directory`, for h2load's -d."""
    path = directory / f"{name}.grpc"
    path.write_bytes(h2load.grpc_frame(body))
    return path


def predict_body(model: str, entity: str) -> bytes:
    return gateway_pb2.PredictRequest(model=model, entity_ids=[entity]).SerializeToString()


# --- the edge: outcomes from its access log -----------------------------------------------


def _epoch_us(start: str) -> int:
    """Envoy's START_TIME (`2026-12-04T22:30:00.123Z`) in µs since the epoch."""
    return int(datetime.fromisoformat(start.replace("Z", "+00:00")).timestamp() * 1e6)


def outcome(entry: Mapping[str, object]) -> str:
    """An access log line's outcome: `reset` for a call the client reset (response flag DC),
    else its gRPC status by name."""
    if "DC" in str(entry.get("flags", "")):
        # Reset by the client, whatever status Envoy inferred for the half-sent answer.
        return "reset"
    status = entry.get("grpc_status")
    if status in (None, "", "-"):
        return "no grpc-status"
    number = int(str(status))
    return STATUS_NAMES.get(number, str(number))


def read_lines(log: Path, offset: int) -> list[dict[str, object]]:
    """The access log's whole lines written after `offset` bytes, parsed."""
    if not log.exists():
        return []
    with log.open("rb") as stream:
        stream.seek(offset)
        data = stream.read()
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def window_outcomes(
    lines: list[dict[str, object]], path: str, opened_us: int, closed_us: int
) -> Counter[str]:
    """Outcomes of the calls to `path` that started in [opened_us, closed_us)."""
    found: Counter[str] = Counter()
    for entry in lines:
        if entry.get("path") != path:
            continue
        if opened_us <= _epoch_us(str(entry["start"])) < closed_us:
            found[outcome(entry)] += 1
    return found


def send_marker(
    dial: Dial, model: str, entity: str, metadata: Sequence[tuple[str, str]] = ()
) -> str:
    """One Predict through the edge with the Python client; its request id (the edge's)."""
    with dial.channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        reply = stub.Predict(
            gateway_pb2.PredictRequest(model=model, entity_ids=[entity]),
            timeout=10,
            metadata=tuple(metadata) or None,
        )
    return str(reply.request_id)


def wait_logged(
    log: Path,
    offset: int,
    request_id: str,
    flush: Callable[[], object] = lambda: None,
    timeout_s: float = LOG_WAIT_S,
) -> list[dict[str, object]]:
    """The access log's lines after `offset`, once the line of `request_id` is among them.
    `flush` asks Envoy to write what it holds (else it writes every 10 s, or per 64 KiB)."""
    deadline = time.monotonic() + timeout_s
    while True:
        flush()
        lines = read_lines(log, offset)
        if any(entry.get("request_id") == request_id for entry in lines):
            return lines
        if time.monotonic() > deadline:
            raise h2load.H2loadUnavailable(
                f"the edge's access log {log} did not show call {request_id} in {timeout_s} s"
            )
        time.sleep(LOG_POLL_S)


def split_cancelled(
    outcomes: Mapping[str, int], concurrency: int, ok_name: str
) -> tuple[int, dict[str, int], int]:
    """(ok, errors by name, cancelled at stop): resets and CANCELLED count as h2load's stop,
    up to one per stream in flight (`concurrency`); any beyond that are errors."""
    stopped = ("reset", "CANCELLED", "cancelled")
    errors = {k: v for k, v in outcomes.items() if k != ok_name and k not in stopped}
    cancelled = sum(outcomes.get(k, 0) for k in stopped)
    if cancelled > concurrency:
        errors["cancelled beyond one per stream"] = cancelled - concurrency
        cancelled = concurrency
    return outcomes.get(ok_name, 0), {k: v for k, v in errors.items() if v}, cancelled


def _client_errors(errors: Mapping[str, int]) -> dict[str, int]:
    """What h2load itself saw fail (connections, timeouts, HTTP statuses), named as such."""
    return {f"client: {name}": count for name, count in errors.items() if count}


def measure_edge(
    address: str,
    body_file: Path,
    concurrency: int,
    seconds: float,
    warmup_s: float,
    timeout_s: float,
    *,
    tls: bool,
    access_log: Path,
    read_cpu: Callable[[], Mapping[str, float]],
    marker: Callable[[], str],
    flush: Callable[[], object] = lambda: None,
    connections: int | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> Measured:
    """h2load against the edge, sending `headers` too (the edge's credentials); outcomes
    from the edge's access log (see the module)."""
    offset = access_log.stat().st_size if access_log.exists() else 0
    window = CpuWindow(read_cpu)
    result = h2load.closed_loop(
        address,
        body_file,
        concurrency,
        seconds,
        warmup_s,
        timeout_s,
        hook=window,
        method=PREDICT_METHOD,
        tls=tls,
        connections=connections,
        headers=headers,
    )
    lines = wait_logged(access_log, offset, marker(), flush)
    outcomes = window_outcomes(lines, PREDICT_METHOD, window.opened_us, window.closed_us)
    return _measured(result, window, *split_cancelled(outcomes, concurrency, "OK"))


def measure_server(
    server: ServerProcess,
    kind: str,
    body_file: Path,
    concurrency: int,
    seconds: float,
    warmup_s: float,
    timeout_s: float,
    connections: int | None = None,
) -> Measured:
    """h2load against a plaintext bench server (the model server alone, or echo): ModelInfer;
    outcomes from the server's own call counter by status (echo keeps none: every answer
    counts)."""
    counters = ServerWindow(server)
    window = CpuWindow(lambda: {kind: server.cpu_seconds()}, also=counters)
    result = h2load.closed_loop(
        server.address,
        body_file,
        concurrency,
        seconds,
        warmup_s,
        timeout_s,
        hook=window,
        method=MODEL_INFER_METHOD,
        connections=connections,
    )
    outcomes = rpc_outcomes(counters.delta, "ModelInfer")
    if not outcomes:  # the echo server keeps no counters, and cannot fail
        return _measured(result, window, result.ok, {}, 0)
    return _measured(result, window, *split_cancelled(outcomes, concurrency, "OK"))


def rpc_outcomes(delta: Mapping[str, float], method: str) -> dict[str, int]:
    """A server's calls of `method` in the window by gRPC status, from its
    servemesh_rpc_requests_total counter (every call the server answered, refused at the
    door or not): the samples as `ServerWindow` keys them, `name|code=...|method=...`."""
    found: dict[str, int] = {}
    for key, value in delta.items():
        name, *labels = key.split("|")
        fields = dict(label.partition("=")[::2] for label in labels)
        if name == "servemesh_rpc_requests_total" and fields.get("method", "").endswith(method):
            code = fields.get("code", "?")
            found[code] = found.get(code, 0) + int(value)
    return {code: count for code, count in found.items() if count}


def _measured(
    result: LoadResult, window: CpuWindow, ok: int, errors: dict[str, int], cancelled: int
) -> Measured:
    """The window's figures: OK answers and failures as the server side counted them, its
    latencies, the CPU spent in the window, and apart what h2load itself saw fail."""
    return Measured(
        ok=ok,
        seconds=window.seconds,
        latencies_ms=result.latencies_ms,
        errors=errors,
        cancelled_at_stop=cancelled,
        cpu_seconds=window.spent,
        client_cpu_seconds=result.client_cpu * window.seconds,
        client_errors=_client_errors(result.errors),
    )
