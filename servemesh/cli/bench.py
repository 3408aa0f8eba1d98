"""`servemesh bench predict|observe|profile|model|pool|stream|batch|scale|layout|compose`:
benchmarks, each on a mesh of its own (batch: a registry and a Redis of its own; pool: a
registry and one on-demand pool's model server).

Every subcommand runs the same way (`cmd_bench`): its benchmark's `main` is called with each
of its parameters from the flag of the same name, and the report it returns is printed, as
JSON with --json, and written to --json-out (servemesh.bench.report.emit)."""

from __future__ import annotations

import argparse
import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from servemesh.cli.flags import add_duration, add_output, add_rate, add_slo, deprecated

if TYPE_CHECKING:
    from servemesh.bench.report import BenchReport

# Each subcommand's benchmark: a module of servemesh.bench whose `main` returns a BenchReport.
BENCHES = {
    "predict": "predict",
    "observe": "observe",
    "profile": "profile",
    "model": "model",
    "pool": "model.pool",
    "stream": "stream",
    "batch": "batch",
    "scale": "scale",
    "layout": "layout",
    "compose": "compose",
}


def bench_main(args: argparse.Namespace) -> Callable[..., BenchReport]:
    """The benchmark a subcommand runs (`predict --tiers` and `batch --through-mesh` run
    another in its place)."""
    module = BENCHES[args.bench]
    if args.bench == "predict" and args.tiers:
        module = "tiers"
    elif args.bench == "batch" and args.through_mesh:
        module = "batch_mesh"
    return importlib.import_module(f"servemesh.bench.{module}").main


def bench_arguments(args: argparse.Namespace, main: Callable[..., BenchReport]) -> dict[str, Any]:
    """`main`'s arguments: each parameter from the flag of its name, `quiet` from --json (a
    report printed as JSON has no progress lines before it). A parameter no flag names is a
    KeyError: a flag renamed on one side only never falls back to a default unnoticed."""
    flags = vars(args) | {"quiet": args.json}
    return {name: flags[name] for name in inspect.signature(main).parameters}


def cmd_bench(args: argparse.Namespace) -> int:
    from servemesh.bench.report import emit

    main = bench_main(args)
    report = main(**bench_arguments(args, main))
    emit(report, json_stdout=args.json, json_out=args.json_out)
    return report.status


def reported(parser: argparse.ArgumentParser) -> None:
    """What every benchmark's command takes for its report (-o/--json, --json-out), and
    the one runner."""
    add_output(parser, "print the report as JSON")
    parser.add_argument("--json-out", help="also write the report here")
    parser.set_defaults(func=cmd_bench)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks (each starts its own mesh on free ports)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bench_predict = bench_sub.add_parser(
        "predict",
        help="Predict through the mesh vs its model server alone, CPU per answer by process",
    )
    bench_predict.add_argument("--spec")
    bench_predict.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    add_duration(bench_predict, "--duration", "per measurement", dest="seconds", default=6.0)
    deprecated(bench_predict, "--seconds", "--duration", dest="seconds", convert=float)
    bench_predict.add_argument("--repeats", type=int, default=3, help="rounds per row (>= 3)")
    bench_predict.add_argument(
        "--direct", action="store_true", help="also load one gateway straight (no Envoy)"
    )
    bench_predict.add_argument(
        "--tls-cost",
        action="store_true",
        help="also the echo server over mutual TLS: what TLS adds to one call's CPU, and to "
        "a Predict's Python sides",
    )
    bench_predict.add_argument(
        "--tiers",
        action="store_true",
        help="instead: a tiered model's req/s, CPU and hit ratio with its tiers on vs off "
        "(a Zipf(1.1) entity mix at the largest --concurrency), and p50 at c=1 of a cached "
        "answer vs the online one",
    )
    bench_predict.add_argument(
        "--entities", type=int, default=100_000, help="--tiers: demo entities (default 100000)"
    )
    bench_predict.add_argument(
        "--precompute",
        type=int,
        default=1000,
        help="--tiers: the hottest entities scored into Redis first (default 1000)",
    )
    bench_predict.add_argument(
        "--freshness",
        choices=["read", "feed"],
        default="read",
        help="--tiers: how the cache knows an answer is fresh (default read: each call reads "
        "the row; feed: hits answer on the store's change feed, with no call)",
    )
    add_duration(
        bench_predict,
        "--idle",
        "the mesh's idle CPU is read over this long, before the load (default 20)",
        dest="idle_seconds",
        default=20.0,
    )
    deprecated(bench_predict, "--idle-seconds", "--idle", dest="idle_seconds", convert=float)
    bench_predict.add_argument(
        "--model",
        choices=["demo", "heavy"],
        default="demo",
        help="the spec's models (demo, default) or the compute-bound heavy MLP alone in their "
        "place (target: edge >= 0.85x the model server alone at c=64)",
    )
    bench_predict.add_argument(
        "--client",
        choices=["python", "h2load"],
        default="python",
        help="python: the asyncio gRPC client (default); h2load: nghttp2's C client, one "
        "pre-built request (one entity), outcomes from the edge's access log; the model "
        "alone is then the standalone model server, plaintext (no --direct, --tls-cost)",
    )
    bench_predict.add_argument(
        "--connections",
        type=int,
        default=1,
        help="h2load: the connections each row's streams share (default 1, one channel's "
        "shape, as the Python client; each --concurrency a multiple of it)",
    )
    reported(bench_predict)
    bench_observe = bench_sub.add_parser(
        "observe",
        help="what tracing and the prediction log cost (a mesh with them against one "
        "without, interleaved), and how soon a sampled trace can be read",
    )
    bench_observe.add_argument("--spec")
    bench_observe.add_argument("--concurrency", type=int, default=64)
    add_duration(bench_observe, "--duration", "per measurement", dest="seconds", default=10.0)
    deprecated(bench_observe, "--seconds", "--duration", dest="seconds", convert=float)
    bench_observe.add_argument("--repeats", type=int, default=3, help="measurements per mesh")
    bench_observe.add_argument(
        "--probes", type=int, default=10, help="sampled Predicts timed to their trace, per phase"
    )
    bench_observe.add_argument(
        "--split", action="store_true", help="also a mesh with tracing only, one with the log only"
    )
    reported(bench_observe)
    bench_profile = bench_sub.add_parser(
        "profile",
        help="sample every Python service with py-spy under Predict load: top frames per kind",
    )
    bench_profile.add_argument("--spec")
    bench_profile.add_argument("--concurrency", type=int, default=64)
    add_duration(bench_profile, "--duration", "sampled, under load", dest="seconds", default=8.0)
    deprecated(bench_profile, "--seconds", "--duration", dest="seconds", convert=float)
    bench_profile.add_argument(
        "--sample-rate", dest="rate", type=int, default=100, help="py-spy's samples/s"
    )
    deprecated(bench_profile, "--rate", "--sample-rate", dest="rate", convert=int)
    bench_profile.add_argument("--top", type=int, default=10, help="frames shown per kind")
    bench_profile.add_argument("--out", help="where the raw stacks go (default: a temp dir)")
    reported(bench_profile)
    bench_model = bench_sub.add_parser(
        "model",
        help="the model server (adaptive, fixed window, batching off) vs echo and in-process",
    )
    bench_model.add_argument("--quick", action="store_true", help="1.5 s per measurement")
    add_duration(bench_model, "--duration", "per measurement (default 4)", dest="seconds")
    deprecated(bench_model, "--seconds", "--duration", dest="seconds", convert=float)
    add_rate(bench_model, "requests/s", "open loop (default 1600)")
    bench_model.add_argument("--concurrency", type=int, nargs="+", help="default: 1 16 64")
    bench_model.add_argument("--server-cpu", type=int, default=0)
    bench_model.add_argument("--client-cpu", type=int, default=1)
    bench_model.add_argument("--no-pin", action="store_true", help="do not pin to CPUs")
    # The report's flags here come before the rest (`reported` adds them last elsewhere).
    bench_model.add_argument("--json-out", help="also write the report here")
    add_output(bench_model, "print the report as JSON")
    bench_model.add_argument(
        "--repeats", type=int, default=3, help="measurements per row (median, min-max)"
    )
    bench_model.add_argument(
        "--against",
        nargs="+",
        choices=["triton"],
        default=[],
        help="peers measured in the same run (triton: pytriton from .venv-pytriton)",
    )
    bench_model.add_argument(
        "--model",
        choices=["demo", "heavy", "trees"],
        default="demo",
        help="demo: the demo MLP, protocol-bound (default); heavy: a 2048-wide MLP exported "
        "with torch.export, compute-bound (closed loops, mean batch formed); trees: a "
        "LightGBM ensemble of 200 trees through ONNX Runtime, against onnxruntime alone",
    )
    bench_model.add_argument(
        "--client",
        choices=["python", "h2load"],
        default="python",
        help="python: the asyncio gRPC client (default); h2load: nghttp2's C client sending "
        "one pre-built request, closed loops only (apt-get install nghttp2-client)",
    )
    bench_model.set_defaults(func=cmd_bench)
    bench_pool = bench_sub.add_parser(
        "pool",
        help="many models in one on-demand pool under a memory budget: calls spread over "
        "every model (uniform, Zipf), errors, hit ratio, cold-call p50/p99, req/s",
    )
    bench_pool.add_argument("--models", type=int, default=20, help="demo models (default 20)")
    bench_pool.add_argument(
        "--fit", type=int, default=5, help="models the budget holds at once (default 5)"
    )
    bench_pool.add_argument("--concurrency", type=int, default=8, help="callers (default 8)")
    add_duration(bench_pool, "--duration", "per round (default 8)", dest="seconds", default=8.0)
    deprecated(bench_pool, "--seconds", "--duration", dest="seconds", convert=float)
    bench_pool.add_argument("--repeats", type=int, default=3, help="rounds per mix (default 3)")
    reported(bench_pool)
    bench_stream = bench_sub.add_parser(
        "stream",
        help="streaming predictions: events/s end to end and p99 event-to-prediction latency "
        "at a fixed input rate, through the mesh and in process",
    )
    bench_stream.add_argument("--spec")
    add_rate(bench_stream, "events/s", "the input's", default=500.0)
    add_duration(bench_stream, "--duration", "per round", dest="seconds", default=10.0)
    deprecated(bench_stream, "--seconds", "--duration", dest="seconds", convert=float)
    bench_stream.add_argument("--repeats", type=int, default=3, help="rounds per mode")
    bench_stream.add_argument("--batch-size", type=int, default=64, help="events per read")
    reported(bench_stream)
    bench_batch = bench_sub.add_parser(
        "batch",
        help="batch scoring in process: rows/s of the whole run against the model alone in a "
        "tight loop on the same rows, for the demo and the wine example's models",
    )
    bench_batch.add_argument(
        "--through-mesh",
        action="store_true",
        help="instead: online Predict p50/p99 at --concurrency through the edge of a mesh, "
        "alone and while `batch score --through-mesh` scores every entity of the view "
        "(--rows, default 400000; the first --batch-size, default 256)",
    )
    bench_batch.add_argument("--spec", help="--through-mesh: the mesh spec (default built in)")
    bench_batch.add_argument(
        "--concurrency", type=int, default=8, help="--through-mesh: online callers (default 8)"
    )
    add_duration(
        bench_batch, "--duration", "--through-mesh: per measurement", dest="seconds", default=6.0
    )
    deprecated(bench_batch, "--seconds", "--duration", dest="seconds", convert=float)
    bench_batch.add_argument(
        "--rows", type=int, help="entities per view (default 20000; --through-mesh 400000)"
    )
    bench_batch.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        help="rows per call of the model (default 64 1024; --through-mesh 256)",
    )
    bench_batch.add_argument(
        "--chunk-rows", type=int, help="rows per read, write and checkpoint (default 16384)"
    )
    bench_batch.add_argument("--repeats", type=int, default=3, help="rounds per row")
    bench_batch.add_argument("--threads", type=int, help="torch intra-op threads")
    reported(bench_batch)
    bench_scale = bench_sub.add_parser(
        "scale",
        help="an open-loop ramp against fixed min, fixed max and autoscaled model servers in "
        "one run: p99 per window, failed calls, replica-seconds; and cold start with and "
        "without a warm standby",
    )
    bench_scale.add_argument("--spec")
    bench_scale.add_argument("--low", type=float, default=20.0, help="req/s at both ends")
    bench_scale.add_argument("--high", type=float, default=300.0, help="req/s at the top")
    add_duration(bench_scale, "--duration", "the whole ramp", dest="seconds", default=90.0)
    deprecated(bench_scale, "--seconds", "--duration", dest="seconds", convert=float)
    add_slo(bench_scale, default=100.0)
    deprecated(bench_scale, "--slo-ms", "--slo", dest="slo_ms", convert=float)
    for end, default, role in (("min", 1, "fixed min, start"), ("max", 3, "fixed max, ceiling")):
        bench_scale.add_argument(
            f"--{end}", dest=f"{end}_replicas", metavar=end.upper(), type=int, default=default,
            help=f"replicas ({role})",
        )  # fmt: skip
    bench_scale.add_argument(
        "--cold-repeats", type=int, default=2, help="scale-ups timed per kind (standby, cold)"
    )
    reported(bench_scale)
    bench_layout = bench_sub.add_parser(
        "layout",
        help="the mesh's shapes against each other in one run (one shared Envoy, an Envoy "
        "per zone, the small-host profile, every service exec'd, one edge, a replicated "
        "store): start-up time and CPU, memory and idle CPU of every process, Predict and "
        "GetFeatures p50 and req/s",
    )
    bench_layout.add_argument("--spec")
    bench_layout.add_argument(
        "--arms",
        nargs="+",
        # servemesh.bench.layout.ARMS and DEFAULT_ARMS (not imported here: it loads the
        # launcher, which every other command would then pay for at start).
        choices=("shared", "per_zone", "small-host", "exec", "one-edge", "replicated"),
        default=["shared", "per_zone"],
        help="the shapes compared, each against the first (default: shared per_zone)",
    )
    bench_layout.add_argument("--repeats", type=int, default=3, help="meshes per arm")
    add_duration(
        bench_layout, "--idle", "idle CPU read over this long", dest="idle_seconds", default=10.0
    )
    deprecated(bench_layout, "--idle-seconds", "--idle", dest="idle_seconds", convert=float)
    add_duration(bench_layout, "--duration", "per Predict round", dest="seconds", default=4.0)
    deprecated(bench_layout, "--seconds", "--duration", dest="seconds", convert=float)
    bench_layout.add_argument(
        "--concurrency", type=int, default=16, help="callers of the req/s round (default 16)"
    )
    bench_layout.add_argument(
        "--feature-concurrency",
        type=int,
        default=64,
        help="callers of the GetFeatures req/s round (default 64)",
    )
    reported(bench_layout)
    bench_compose = bench_sub.add_parser(
        "compose",
        help="Predict through the compose mesh's edge (containers, make compose-up) against "
        "servemesh up's (processes), the same spec, in one run: req/s and p50, compose/up",
    )
    bench_compose.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    add_duration(bench_compose, "--duration", "per round", dest="seconds", default=5.0)
    bench_compose.add_argument("--repeats", type=int, default=3, help="rounds per mesh")
    bench_compose.add_argument(
        "--edge-port", type=int, default=18543, help="the compose edge's port on the host"
    )
    reported(bench_compose)
