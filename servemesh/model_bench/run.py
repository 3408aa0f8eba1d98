"""`servemesh bench model`: the model server against its own references, in one run.

Every target is a separate process pinned to the server CPU; the load generator is this
process, pinned to the client CPU (the setup of the Triton measurement in issue #3):

| target | what it is |
| --- | --- |
| servemesh adaptive | the model server as shipped: adaptive dispatch, deadlines enforced |
| fixed window | Triton's policy: the same max delay, always waited out, deadline-blind FIFO |
| batching off | the model server with max_batch_size 1 |
| echo | the same gRPC stack answering without a model: the protocol ceiling |
| in-process | the model with no gRPC (forward passes; the batcher fed by coroutines) |

Each server target gets closed loops (concurrency 1, 16, 64 by default) and an open loop
at a fixed rate. Adaptive and fixed window also get the deadline mix: an open loop at 1.3x
the adaptive server's capacity in which 30% of callers carry a 20 ms deadline (the rest
1 s), reporting goodput and, from the server's own counters, how many expired requests the
model computed. The mix runs twice: on the demo MLP, where the overload queues up inside
gRPC before any request reaches the batcher (protocol-bound), and on the same MLP made
model-bound (4 ms added to every batch of at most 8, as a slower or accelerator-hosted
model would take), where the queue forms in the batcher.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from servemesh.model_bench.load import LoadResult, closed_loop, open_loop, request_bodies
from servemesh.procs import Check, StartError, Supervisor

TRITON_C64_RPS = 1070.0  # issue #3: Triton 2.51 (pytriton), same box and setup, c=64
TRITON_C64_P99_MS = 87.0


SLOW_MODEL_MS = 4.0  # added to every batch of the model-bound targets
SLOW_MAX_BATCH = 8


@dataclass(frozen=True)
class Target:
    name: str
    kind: str  # model, echo
    batching: dict[str, Any] = field(default_factory=dict)
    inject_latency_ms: float = 0.0
    # closed: every concurrency; capacity: closed loop at the top concurrency only;
    # open: the fixed-rate open loop; mix: the deadline mix.
    scenarios: tuple[str, ...] = ("closed", "open")
    # Deadline mixes of one group share their offered rate: 1.3x the capacity measured on
    # the group's first target.
    group: str = "protocol-bound"


@dataclass
class BenchConfig:
    seconds: float = 4.0
    warmup_s: float = 1.0
    concurrencies: tuple[int, ...] = (1, 16, 64)
    rate: float = 1600.0
    overload: float = 1.3
    short_share: float = 0.3
    short_deadline_ms: float = 20.0
    long_deadline_ms: float = 1000.0
    max_batch_size: int = 64
    max_queue_delay_ms: float = 2.0
    server_cpu: int | None = 0
    client_cpu: int | None = 1

    def targets(self) -> list[Target]:
        common = {
            "max_batch_size": self.max_batch_size,
            "max_queue_delay_ms": self.max_queue_delay_ms,
        }
        # Triton's policy: the window always waited out, FIFO, deadline-blind.
        fixed = {"dispatch": "fixed_window", "deadline_policy": "ignore"}
        slow = {**common, "max_batch_size": SLOW_MAX_BATCH}
        everything = ("closed", "open", "mix")
        return [
            Target("servemesh adaptive", "model", dict(common), scenarios=everything),
            Target("fixed window", "model", {**common, **fixed}, scenarios=everything),
            Target("batching off", "model", {**common, "max_batch_size": 1}),
            Target("echo (protocol ceiling)", "echo"),
            Target(
                "adaptive, slow model",
                "model",
                slow,
                SLOW_MODEL_MS,
                ("capacity", "mix"),
                "model-bound",
            ),
            Target(
                "fixed window, slow model",
                "model",
                {**slow, **fixed},
                SLOW_MODEL_MS,
                ("capacity", "mix"),
                "model-bound",
            ),
        ]


# --- the server side: processes, CPU time, metrics -------------------------------------


class ServerProcess:
    def __init__(self, target: Target, cpu: int | None, workdir: Path) -> None:
        self.target = target
        port_file = workdir / f"{target.name.split()[0]}-{time.monotonic_ns()}.json"
        argv = [
            sys.executable,
            "-m",
            "servemesh.model_bench.targets",
            target.kind,
            "--batching",
            json.dumps(target.batching),
            "--port-file",
            str(port_file),
        ]
        if cpu is not None:
            argv += ["--cpu", str(cpu)]
        if target.inject_latency_ms:
            argv += ["--inject-latency-ms", str(target.inject_latency_ms)]
        self.name = target.name.split()[0]
        # One supervisor per server: its forking thread lives exactly as long as the server.
        self.supervisor = Supervisor(workdir, grace_s=15.0, thread_name="bench-spawner")
        ready = Check(port_file.exists, f"{port_file.name} written")
        try:
            self.pid = self.supervisor.start(self.name, argv, ready=ready, timeout_s=120).pid
        except StartError as exc:
            self.stop()
            raise RuntimeError(f"{target.name} did not start: {exc}") from None
        ports = json.loads(port_file.read_text())
        self.address = f"127.0.0.1:{ports['port']}"
        self.metrics_port = int(ports["metrics_port"])

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, by name and labels (empty for the echo server)."""
        if not self.metrics_port:
            return {}
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                extra = {k: v for k, v in sample.labels.items() if k not in ("model", "version")}
                key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(extra.items()))
                samples[key] = sample.value
        return samples

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; the log stays in the work dir."""
        self.supervisor.close()


@contextmanager
def running(target: Target, cpu: int | None, workdir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(target, cpu, workdir)
    try:
        yield server
    finally:
        server.stop()


class ServerWindow:
    """Server CPU time and metrics at the start and end of a measured window."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.cpu = 0.0
        self.wall = 0.0
        self.before: dict[str, float] = {}
        self.delta: dict[str, float] = {}

    def __call__(self, opening: bool) -> None:
        if opening:
            self.before = self.server.metrics()
            self.cpu, self.wall = self.server.cpu_seconds(), time.perf_counter()
            return
        self.cpu = (self.server.cpu_seconds() - self.cpu) / (time.perf_counter() - self.wall)
        after = self.server.metrics()
        self.delta = {key: after[key] - self.before.get(key, 0.0) for key in after}

    def row(self) -> dict[str, Any]:
        delta = self.delta
        executions = delta.get("servemesh_model_executions_total", 0.0)
        rows = delta.get("servemesh_model_inferences_total", 0.0)
        prefix = "servemesh_model_requests_total|outcome="
        return {
            "server_cpu": round(self.cpu, 3),
            "mean_batch": round(rows / executions, 2) if executions else None,
            "outcomes": {
                k[len(prefix) :]: int(v) for k, v in delta.items() if k.startswith(prefix)
            },
            "expired_computed": int(delta.get("servemesh_model_expired_computed_total", 0.0)),
        }


# --- the run -------------------------------------------------------------------------


def _pin_client(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def _row(target: str, result: LoadResult, window: ServerWindow) -> dict[str, Any]:
    return {"target": target, **result.summary(), **window.row()}


def ceiling(config: BenchConfig) -> dict[str, Any]:
    argv = [sys.executable, "-m", "servemesh.model_bench.targets", "ceiling"]
    argv += ["--seconds", str(max(1.5, config.seconds)), "--batching"]
    argv += [json.dumps({"max_batch_size": config.max_batch_size})]
    if config.server_cpu is not None:
        argv += ["--cpu", str(config.server_cpu)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def bench_model(config: BenchConfig, say: Any = print) -> dict[str, Any]:
    """Run every target and scenario; returns the report (rows, ceilings, checks)."""
    _pin_client(config.client_cpu)
    bodies = request_bodies("fraud")
    rows: list[dict[str, Any]] = []
    mix_rates: dict[str, float] = {}
    say("in-process ceiling (model and batcher, no gRPC)...")
    ceilings = ceiling(config)
    with tempfile.TemporaryDirectory(prefix="servemesh-bench-") as tmp:
        for target in config.targets():
            say(f"{target.name}: starting")
            with running(target, config.server_cpu, Path(tmp)) as server:
                rows.extend(_measure(config, target, server, bodies, mix_rates, say))
    report = {
        "date": date.today().isoformat(),
        "config": {
            k: v for k, v in vars(config).items() if not k.startswith("_") and k != "targets"
        },
        "versions": _versions(),
        "ceilings": ceilings,
        "mix_rates": mix_rates,
        "rows": rows,
    }
    report["checks"] = checks(report)
    return report


def _measure(
    config: BenchConfig,
    target: Target,
    server: ServerProcess,
    bodies: list[bytes],
    mix_rates: dict[str, float],
    say: Any,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    concurrencies: tuple[int, ...] = ()
    if "closed" in target.scenarios:
        concurrencies = config.concurrencies
    elif "capacity" in target.scenarios:
        concurrencies = (max(config.concurrencies),)
    for concurrency in concurrencies:
        window = ServerWindow(server)
        result = asyncio.run(
            closed_loop(
                server.address, bodies, concurrency, config.seconds, config.warmup_s, hook=window
            )
        )
        rows.append(_row(target.name, result, window))
        say(f"  closed c={concurrency}: {result.rps:.0f} req/s")
    if "open" in target.scenarios:
        window = ServerWindow(server)
        result = asyncio.run(
            open_loop(
                server.address, bodies, config.rate, config.seconds, config.warmup_s, hook=window
            )
        )
        rows.append(_row(target.name, result, window))
        say(
            f"  open {config.rate:.0f}/s: {result.rps:.0f} req/s ok, "
            f"sends late by {result.send_lag_p99_ms:.1f} ms at p99"
        )
    if "mix" in target.scenarios:
        if target.group not in mix_rates:
            capacity = max((r["rps"] for r in rows if r["mode"] == "closed"), default=1000.0)
            mix_rates[target.group] = round(capacity * config.overload, -1)
        rate = mix_rates[target.group]
        row = _deadline_mix(config, server, bodies, rate, target)
        rows.append(row)
        say(f"  deadline mix at {rate:.0f}/s: {row['rps']:.0f} good/s")
    return rows


def _deadline_mix(
    config: BenchConfig, server: ServerProcess, bodies: list[bytes], rate: float, target: Target
) -> dict[str, Any]:
    # Every tenth caller from a fixed pattern: short_share of them carry the short deadline.
    shorts = max(0, min(10, round(config.short_share * 10)))
    pattern = [i * 10 // shorts for i in range(shorts)] if shorts else []
    short_slots = frozenset(pattern)

    def is_short(index: int) -> bool:
        return index % 10 in short_slots

    def timeout_for(index: int) -> float:
        return (config.short_deadline_ms if is_short(index) else config.long_deadline_ms) / 1000

    window = ServerWindow(server)
    result = asyncio.run(
        open_loop(
            server.address,
            bodies,
            rate,
            config.seconds,
            config.warmup_s,
            timeout_for=timeout_for,
            is_short=is_short,
            hook=window,
        )
    )
    row = _row(target.name, result, window)
    row["group"] = target.group
    return row


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for package in ("torch", "grpcio", "protobuf", "numpy"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    found["python"] = sys.version.split()[0]
    return found


def _find(rows: list[dict[str, Any]], target: str, mode: str, concurrency: int = 0) -> Any:
    for row in rows:
        if row["target"] == target and row["mode"] == mode:
            if mode != "closed" or row["concurrency"] == concurrency:
                return row
    return None


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue #3's targets, each with the measured value and whether it was met."""
    rows = report["rows"]
    adaptive64 = _find(rows, "servemesh adaptive", "closed", 64)
    adaptive1 = _find(rows, "servemesh adaptive", "closed", 1)
    off64 = _find(rows, "batching off", "closed", 64)
    echo64 = _find(rows, "echo (protocol ceiling)", "closed", 64)
    found: list[dict[str, Any]] = []

    def check(name: str, value: float, goal: str, met: bool) -> None:
        found.append({"target": name, "value": round(value, 2), "goal": goal, "met": met})

    if adaptive64:
        ratio = adaptive64["rps"] / TRITON_C64_RPS
        check("c=64 req/s vs Triton's 1,070 (x)", ratio, ">= 1.5", ratio >= 1.5)
        p99 = adaptive64["p99_ms"]
        check("c=64 p99 (ms)", p99, "<= 87", p99 <= TRITON_C64_P99_MS)
        if off64 and off64["rps"]:
            ratio = adaptive64["rps"] / off64["rps"]
            check("c=64 req/s vs batching off (x)", ratio, ">= 4", ratio >= 4.0)
        if echo64 and echo64["rps"]:
            share = adaptive64["rps"] / echo64["rps"]
            check("c=64 req/s vs the echo ceiling (x)", share, ">= 0.7", share >= 0.7)
    if adaptive1:
        p50 = adaptive1["p50_ms"]
        check("c=1 p50 (ms)", p50, "<= 2", p50 <= 2.0)
    for adaptive, fixed, group in (
        ("adaptive, slow model", "fixed window, slow model", "model-bound"),
        ("servemesh adaptive", "fixed window", "protocol-bound"),
    ):
        mix = _find(rows, adaptive, "deadline-mix")
        fixed_mix = _find(rows, fixed, "deadline-mix")
        if mix:
            computed = mix["expired_computed"]
            check(f"{group} mix: expired requests computed", computed, "0", computed == 0)
        if mix and fixed_mix and fixed_mix["rps"]:
            # Runs on this box move by 10-20%: "higher" needs a margin to mean anything.
            ratio = mix["rps"] / fixed_mix["rps"]
            check(f"{group} mix: goodput vs fixed window (x)", ratio, ">= 1.1", ratio >= 1.1)
    return found


# --- output ----------------------------------------------------------------------------


def _ms(value: Any) -> str:
    return "-" if value is None or value != value else f"{value:.2f}"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    # Wide enough for every column when the output goes to a file or a pipe.
    console = Console(width=None if sys.stdout.isatty() else 150)
    ceilings = report["ceilings"]
    table = Table(title="In-process references (no gRPC), on the server CPU", title_justify="left")
    for column in ("reference", "rows/s or req/s", "note"):
        table.add_column(column, justify="left" if column != "rows/s or req/s" else "right")
    for key, value in ceilings.items():
        if key.startswith("forward_b"):
            note = f"{value['ms_per_call']:.3f} ms per call"
            table.add_row(f"model forward, batch {key[9:]}", f"{value['rows_per_s']:.0f}", note)
        else:
            note = f"mean batch {value['mean_batch']}"
            table.add_row(
                f"batcher, {value['concurrency']} coroutines", f"{value['req_per_s']:.0f}", note
            )
    console.print(table)

    table = Table(title="ModelInfer, 1 row per request", title_justify="left")
    columns = ["target", "load", "req/s", "p50 ms", "p95 ms", "p99 ms", "errors"]
    columns += ["mean batch", "server CPU", "client CPU"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("target", "load") else "right")
    for row in report["rows"]:
        if row["mode"] == "deadline-mix":
            continue
        load = (
            f"closed c={row['concurrency']}"
            if row["mode"] == "closed"
            else (f"open {row['rate']:.0f}/s")
        )
        table.add_row(
            row["target"],
            load,
            f"{row['rps']:.0f}",
            _ms(row["p50_ms"]),
            _ms(row["p95_ms"]),
            _ms(row["p99_ms"]),
            str(row["error_count"]),
            "-" if row["mean_batch"] is None else f"{row['mean_batch']:.1f}",
            f"{row['server_cpu']:.0%}",
            f"{row['client_cpu']:.0%}",
        )
    console.print(table)

    mix_rows = [row for row in report["rows"] if row["mode"] == "deadline-mix"]
    if mix_rows:
        config = report["config"]
        table = Table(
            title=(
                f"Deadline mix: open loop, {config['short_share']:.0%} of callers with a "
                f"{config['short_deadline_ms']:.0f} ms deadline, the rest "
                f"{config['long_deadline_ms']:.0f} ms"
            ),
            title_justify="left",
        )
        columns = ["target", "offered/s", "goodput/s", "short ok", "errors by code"]
        columns += ["dropped unrun", "expired computed", "mean batch", "server CPU"]
        for column in columns:
            table.add_column(column, justify="left" if column == "target" else "right")
        for row in mix_rows:
            outcomes = row["outcomes"]
            dropped = sum(outcomes.get(k, 0) for k in ("expired", "refused", "cancelled"))
            table.add_row(
                row["target"],
                f"{row['rate']:.0f}",
                f"{row['rps']:.0f}",
                f"{row['short_ok']}/{row['short_sent']}",
                ", ".join(f"{k} {v}" for k, v in sorted(row["errors"].items())) or "0",
                str(dropped),
                str(row["expired_computed"]),
                "-" if row["mean_batch"] is None else f"{row['mean_batch']:.1f}",
                f"{row['server_cpu']:.0%}",
            )
        console.print(table)

    table = Table(title="Issue #3 targets", title_justify="left")
    for column in ("target", "measured", "goal", "met"):
        table.add_column(column, justify="left" if column == "target" else "right")
    for check in report["checks"]:
        met = "yes" if check["met"] else "[red]no[/red]"
        table.add_row(check["target"], f"{check['value']}", check["goal"], met)
    console.print(table)


def main(
    *,
    quick: bool = False,
    seconds: float | None = None,
    rate: float | None = None,
    concurrencies: list[int] | None = None,
    json_out: str | None = None,
    server_cpu: int | None = 0,
    client_cpu: int | None = 1,
) -> int:
    config = BenchConfig(server_cpu=server_cpu, client_cpu=client_cpu)
    if quick:
        config.seconds, config.warmup_s = 1.5, 0.5
    if seconds is not None:
        config.seconds = seconds
    if rate is not None:
        config.rate = rate
    if concurrencies:
        config.concurrencies = tuple(concurrencies)
    if hasattr(os, "sched_getaffinity"):
        cpus = os.sched_getaffinity(0)
        for cpu in (config.server_cpu, config.client_cpu):
            if cpu is not None and cpu not in cpus:
                raise SystemExit(f"CPU {cpu} is not available here (have {sorted(cpus)})")
    report = bench_model(config, say=lambda text: print(text, file=sys.stderr, flush=True))
    print_report(report)
    for row in report["rows"]:
        row.pop("latencies_ms", None)
    text = json.dumps(report)
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2))
    print(text)
    return 0
