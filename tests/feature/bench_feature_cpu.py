"""CPU per GetFeatures of a feature service process: this tree against a baseline commit,
measured in one run on one Redis and one loaded view.

    python -m tests.feature.bench_feature_cpu [--baseline REF] [--repeats 5] [--calls 3000]

Each variant is a real feature service process (`python -m servemesh.services.feature`,
mutual TLS on its port, as the mesh runs it), the baseline's code taken from `git archive`
of the baseline commit and imported instead of this tree's. Both read the same view
(64 features, `--entities` rows) from the same Redis. A closed-loop grpc.aio client keeps
`--concurrency` calls in flight; the service's CPU (utime + stime from /proc/PID/stat) over
`--calls` calls, divided by the calls, is its CPU per call. The baseline runs without
hiredis unless `--baseline-hiredis` (the baseline's dependencies did not install it). The
variants take turns within each repeat, so load from elsewhere on the machine falls on all
of them alike; the table shows the median and the min-max of the repeats, and the ratio of
the medians. A Health/Check on each process gives the floor every call pays.

Variants:
- baseline: the baseline commit's service; the client sends today's plain request.
- plain: this tree's service, the plain request (values as a repeated float per vector).
- packed: this tree's service, the request `wire.build_request` builds (the packed answer
  the gateway asks for), read back with `wire.read_matrix`.

Tracing is off in the bench spec (no trace store runs here): the figures are the service's
own path. `--py-spy DIR` also records a profile of each variant (py-spy must be installed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.control_credential import control_metadata, ensure_control_token
from servemesh.contract.demo import DEMO_FEATURES
from servemesh.identity import dial_service
from servemesh.procs import GrpcHealth, RedisServer, Supervisor
from servemesh.spec import (
    FeatureStoreSpec,
    FeatureViewSpec,
    Limits,
    MeshSpec,
    Ports,
    Replicas,
    ResolvedSpec,
    TracingSpec,
    dump_spec,
    resolve,
)
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc

INSTANCE = "feature-zone-a-0"
VIEW = "user"
REPO = Path(__file__).resolve().parents[2]
# The package roots of this repository (pyproject's package-dir), relative to a checkout.
PACKAGE_DIRS = {
    "servemesh": "servemesh",
    "servemesh.chaos": "chaos",
    "servemesh.registry": "registry",
    "servemesh.services": "services",
    "servemesh_api": "protos/servemesh_api",
}
# Started with `python -c BOOT ROOT ARGS...`: imports this repository's packages from ROOT
# (a checkout of another commit) instead of the installed tree, then runs the service.
BOOT = """
import runpy, sys
from importlib.machinery import PathFinder
from importlib.util import spec_from_file_location
from pathlib import Path
root = Path(sys.argv.pop(1))
if sys.argv.pop(1) == "no-hiredis":
    sys.modules["hiredis"] = None  # as installed from the baseline's own dependencies
homes = {name: root / where for name, where in %r.items()}
class Checkout:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        home = homes.get(name)
        if home is None:
            return None
        return spec_from_file_location(
            name, home / "__init__.py", submodule_search_locations=[str(home)])
sys.meta_path[:] = [Checkout] + [
    f for f in sys.meta_path if type(f).__name__ != "_EditableFinder"
    and getattr(f, "__name__", "") != "_EditableFinder"]
runpy.run_module("servemesh.services.feature", run_name="__main__", alter_sys=True)
""" % (PACKAGE_DIRS,)


def bench_spec(redis_url: str, state_dir: Path, key_prefix: str) -> ResolvedSpec:
    """A one-zone mesh whose feature service serves the demo's user view."""
    return resolve(
        MeshSpec(
            zones=["zone-a"],
            ports=Ports.free(),
            state_dir=str(state_dir),
            gateway=Replicas(per_zone={"zone-a": 1}),
            feature=Replicas(per_zone={"zone-a": 1}),
            model_servers=Replicas(per_zone={"zone-a": 1}),
            feature_views={VIEW: FeatureViewSpec(features=list(DEMO_FEATURES))},
            feature_store=FeatureStoreSpec(redis_url=redis_url, key_prefix=key_prefix),
            tracing=TracingSpec(enabled=False),
            limits=Limits(),
        )
    )


@dataclass
class Variant:
    name: str
    spec: ResolvedSpec
    pid: int = 0
    build: Callable[[list[str], list[str]], feature_pb2.GetFeaturesRequest] = field(
        default=lambda ids, names: feature_pb2.GetFeaturesRequest(
            view=VIEW, entity_ids=ids, feature_names=names
        )
    )
    read: Callable[[feature_pb2.GetFeaturesResponse, int], np.ndarray] | None = None
    samples: dict[int, list[float]] = field(default_factory=dict)
    floor: list[float] = field(default_factory=list)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def checkout(ref: str, into: Path) -> Path:
    """The files of commit `ref` under `into` (git archive, no work tree of its own)."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


async def load_view(stub: feature_pb2_grpc.FeatureServiceStub, ids: list[str]) -> None:
    """Replace the view with one row per id (random values, event time: now)."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal((len(ids), len(DEMO_FEATURES))).astype("<f4")

    async def messages():
        yield feature_pb2.LoadFeaturesRequest(
            header=feature_pb2.LoadHeader(view=VIEW, feature_names=DEMO_FEATURES, source="bench")
        )
        step = 1000
        for first in range(0, len(ids), step):
            yield feature_pb2.LoadFeaturesRequest(
                chunk=feature_pb2.LoadChunk(
                    entity_ids=ids[first : first + step],
                    values=values[first : first + step].tobytes(),
                    first_row=first,
                )
            )
        yield feature_pb2.LoadFeaturesRequest(commit=feature_pb2.LoadCommit(rows=len(ids)))

    await stub.LoadFeatures(messages())


async def drive_health(
    channel: grpc.aio.Channel, variant: Variant, calls: int, concurrency: int
) -> float:
    """Seconds of the service's CPU per Health/Check: what every call to the process pays
    (TLS, HTTP/2, the runtime's interceptors) before its handler does anything."""
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest()
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await stub.Check(request, timeout=10)

    before = cpu_seconds(variant.pid)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (cpu_seconds(variant.pid) - before) / calls


async def drive(
    stub: feature_pb2_grpc.FeatureServiceStub,
    variant: Variant,
    ids: Sequence[str],
    per_call: int,
    calls: int,
    concurrency: int,
) -> float:
    """Seconds of the service's CPU per call over `calls` calls, `concurrency` in flight."""
    rng = random.Random(per_call)
    names = list(DEMO_FEATURES)
    requests = [variant.build(rng.sample(list(ids), per_call), names) for _ in range(256)]
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            reply = await stub.GetFeatures(requests[left % len(requests)], timeout=10)
            if variant.read is not None:
                variant.read(reply, len(names))
            elif len(reply.vectors) != per_call:
                raise RuntimeError(f"{variant.name}: {len(reply.vectors)} vectors")

    before = cpu_seconds(variant.pid)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (cpu_seconds(variant.pid) - before) / calls


def _row(name: str, per_call: int, samples: list[float], base: float | None) -> str:
    median = statistics.median(samples)
    spread = (max(samples) - min(samples)) / median * 100 if median else 0.0
    ratio = f"{median / base:.2f}x" if base else "-"
    flag = "  (spread > 25%: re-run)" if spread > 25 else ""
    return (
        f"| {name:<8} | {per_call:>3} | {median * 1e6:>7.0f} | "
        f"{min(samples) * 1e6:>5.0f}-{max(samples) * 1e6:<5.0f} | {spread:>4.0f}% | "
        f"{ratio:>6} |{flag}"
    )


def report(variants: list[Variant], sizes: Sequence[int], repeats: int) -> str:
    lines = [
        f"CPU per GetFeatures of the feature service, µs (median of {repeats}, min-max; "
        "ratio: median / baseline median)",
        "| variant  | ids | median | min-max | spread | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for per_call in sizes:
        base = statistics.median(variants[0].samples[per_call])
        for variant in variants:
            samples = variant.samples[per_call]
            ratio_base = None if variant is variants[0] else base
            lines.append(_row(variant.name, per_call, samples, ratio_base))
    lines += [
        "",
        "Health/Check on the same process (the floor every call pays: TLS, HTTP/2, the "
        "runtime's interceptors), and GetFeatures above it (median - floor median), µs",
        "| variant  | floor | min-max | above floor, "
        + ", ".join(f"{n} ids" for n in sizes)
        + " |",
        "|---|---|---|---|",
    ]
    for variant in variants:
        floor = statistics.median(variant.floor)
        above = ", ".join(
            f"{(statistics.median(variant.samples[n]) - floor) * 1e6:.0f}" for n in sizes
        )
        lines.append(
            f"| {variant.name:<8} | {floor * 1e6:>5.0f} | {min(variant.floor) * 1e6:.0f}-"
            f"{max(variant.floor) * 1e6:.0f} | {above} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline",
        help="commit to compare with (default: where this branch left main, git merge-base)",
    )
    parser.add_argument(
        "--baseline-hiredis",
        action="store_true",
        help="let the baseline's redis-py use hiredis (by default it runs without, as the "
        "baseline's own dependencies install it)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000, help="calls per sample")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--entities", type=int, default=5000, help="rows in the view")
    parser.add_argument("--sizes", default="1,16", help="entity ids per call")
    parser.add_argument("--py-spy", type=Path, help="record a profile of each variant here")
    parser.add_argument(
        "--py-spy-native", action="store_true", help="with native frames and thread ids"
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if not args.baseline:
        args.baseline = subprocess.run(
            ["git", "-C", str(REPO), "merge-base", "HEAD", "main"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()[:12]
    work = Path(tempfile.mkdtemp(prefix="bench-feature-"))
    try:
        with Supervisor(work / "logs") as supervisor:
            return asyncio.run(_run(args, sizes, work, supervisor))
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _run(args: argparse.Namespace, sizes: list[int], work: Path, sup: Supervisor) -> int:
    from servemesh.services.feature.wire import build_request, read_matrix

    redis = RedisServer(sup, work / "redis")
    redis.start(timeout_s=10)
    state_dir = work / "state"
    state_dir.mkdir()
    ensure_control_token(state_dir)
    url = f"redis://:{redis.password}@{redis.host}:{redis.port}/0"
    prefix = f"bench{os.getpid()}"
    base_root = checkout(args.baseline, work / "baseline")
    variants = [
        Variant("baseline", bench_spec(url, state_dir, prefix)),
        Variant("plain", bench_spec(url, state_dir, prefix)),
        Variant("packed", bench_spec(url, state_dir, prefix), build=_packed(build_request)),
    ]
    variants[2].read = read_matrix
    for variant in variants:
        spec_file = state_dir / f"{variant.name}.yaml"
        spec_file.write_text(dump_spec(variant.spec))
        service = ["--spec", str(spec_file), "--instance", INSTANCE, "--log-level", "WARNING"]
        if variant.name == "baseline":
            hiredis = "hiredis" if args.baseline_hiredis else "no-hiredis"
            argv = [sys.executable, "-c", BOOT, str(base_root), hiredis, *service]
        else:
            argv = [sys.executable, "-m", "servemesh.services.feature", *service]
        ready = GrpcHealth(dial_service(variant.spec, INSTANCE))
        variant.pid = sup.start(variant.name, argv, ready=ready, timeout_s=60).pid
    channels = [dial_service(v.spec, INSTANCE).aio_channel() for v in variants]
    stubs = [feature_pb2_grpc.FeatureServiceStub(c) for c in channels]
    ids = [f"u{i:05d}" for i in range(args.entities)]
    await load_view(_with_control(stubs[1], channels[1], state_dir), ids)
    # Warm-up: connections, caches, first reads after the load.
    for stub, variant in zip(stubs, variants, strict=True):
        for per_call in sizes:
            await drive(stub, variant, ids, per_call, 300, args.concurrency)
    print(
        f"baseline {args.baseline} ({'with' if args.baseline_hiredis else 'without'} "
        f"hiredis); {args.calls} calls per sample, {args.concurrency} in "
        f"flight, {args.entities} rows x {len(DEMO_FEATURES)} features",
        flush=True,
    )
    for repeat in range(args.repeats):
        for per_call in sizes:
            for stub, variant in zip(stubs, variants, strict=True):
                spent = await drive(stub, variant, ids, per_call, args.calls, args.concurrency)
                variant.samples.setdefault(per_call, []).append(spent)
        for channel, variant in zip(channels, variants, strict=True):
            variant.floor.append(await drive_health(channel, variant, args.calls, args.concurrency))
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    if args.py_spy:
        await _profile(args, stubs, variants, ids, sizes)
    print(report(variants, sizes, args.repeats))
    for channel in channels:
        await channel.close()
    return 0


def _packed(
    build_request: Callable[[str, Sequence[str], Sequence[str]], feature_pb2.GetFeaturesRequest],
) -> Callable[[list[str], list[str]], feature_pb2.GetFeaturesRequest]:
    return lambda ids, names: build_request(VIEW, ids, names)


def _with_control(
    stub: feature_pb2_grpc.FeatureServiceStub, channel: grpc.aio.Channel, state_dir: Path
) -> feature_pb2_grpc.FeatureServiceStub:
    """A stub whose LoadFeatures carries the mesh's control credential."""
    credential = control_metadata(ensure_control_token(state_dir))

    class Loading:
        async def LoadFeatures(self, messages):  # noqa: N802
            return await stub.LoadFeatures(messages, metadata=credential, timeout=120)

    return Loading()  # type: ignore[return-value]


async def _profile(
    args: argparse.Namespace,
    stubs: list[feature_pb2_grpc.FeatureServiceStub],
    variants: list[Variant],
    ids: list[str],
    sizes: list[int],
) -> None:
    """py-spy record (raw, collapsed stacks) of each variant under the same load."""
    args.py_spy.mkdir(parents=True, exist_ok=True)
    for stub, variant in zip(stubs, variants, strict=True):
        for per_call in sizes:
            out = args.py_spy / f"{variant.name}-{per_call}.txt"
            native = ["--native", "--threads"] if args.py_spy_native else ["--nonblocking"]
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--format",
                    "raw",
                    "--rate",
                    "500",
                    *native,
                    "-o",
                    str(out),
                    "--pid",
                    str(variant.pid),
                ],  # fmt: skip
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # py-spy attaches
            await drive(stub, variant, ids, per_call, args.calls, args.concurrency)
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
