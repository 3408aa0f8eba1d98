"""`servemesh bench predict|observe|profile|model|stream|batch`: benchmarks, each on a mesh of
its own (batch: a registry and a Redis of its own)."""

from __future__ import annotations

import argparse


def cmd_bench_predict(args: argparse.Namespace) -> int:
    from servemesh.bench import main as bench_main

    if args.tiers:
        from servemesh.spec import load_spec
        from servemesh.tiers_bench import main as bench_tiers_main

        return bench_tiers_main(
            load_spec(args.spec),
            entities=args.entities,
            precomputed=args.precompute,
            concurrency=max(args.concurrency),
            seconds=args.seconds,
            repeats=args.repeats,
            out=args.json_out,
            as_json=args.json,
        )

    return bench_main(
        args.spec,
        args.concurrency,
        args.seconds,
        args.json_out,
        repeats=args.repeats,
        as_json=args.json,
        direct=args.direct,
    )


def cmd_bench_observe(args: argparse.Namespace) -> int:
    from servemesh.observe_bench import main as bench_observe_main

    return bench_observe_main(
        args.spec,
        concurrency=args.concurrency,
        seconds=args.seconds,
        repeats=args.repeats,
        probes=args.probes,
        split=args.split,
        out=args.json_out,
    )


def cmd_bench_profile(args: argparse.Namespace) -> int:
    from servemesh.profile_bench import main as bench_profile_main

    return bench_profile_main(
        args.spec,
        args.out,
        concurrency=args.concurrency,
        seconds=args.seconds,
        rate_hz=args.rate,
        top=args.top,
        json_out=args.json_out,
    )


def cmd_bench_model(args: argparse.Namespace) -> int:
    from servemesh.model_bench import main as bench_model_main

    return bench_model_main(
        quick=args.quick,
        seconds=args.seconds,
        rate=args.rate,
        concurrencies=args.concurrency,
        json_out=args.json_out,
        server_cpu=None if args.no_pin else args.server_cpu,
        client_cpu=None if args.no_pin else args.client_cpu,
        repeats=args.repeats,
        against=args.against,
        as_json=args.json,
    )


def cmd_bench_stream(args: argparse.Namespace) -> int:
    from servemesh.stream_bench import main as bench_stream_main

    return bench_stream_main(
        args.spec,
        rate=args.rate,
        seconds=args.seconds,
        repeats=args.repeats,
        batch_size=args.batch_size,
        out=args.json_out,
        as_json=args.json,
    )


def cmd_bench_batch(args: argparse.Namespace) -> int:
    from servemesh.batch_bench import main as bench_batch_main

    return bench_batch_main(
        rows=args.rows,
        batch_sizes=args.batch_size,
        repeats=args.repeats,
        threads=args.threads,
        json_out=args.json_out,
        as_json=args.json,
        chunk_rows=args.chunk_rows,
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks (each starts its own mesh on free ports)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bench_predict = bench_sub.add_parser(
        "predict",
        help="Predict through the mesh vs its model server alone, CPU per answer by process",
    )
    bench_predict.add_argument("--spec")
    bench_predict.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    bench_predict.add_argument("--seconds", type=float, default=6.0, help="per measurement")
    bench_predict.add_argument("--repeats", type=int, default=3, help="rounds per row (>= 3)")
    bench_predict.add_argument(
        "--direct", action="store_true", help="also load one gateway straight (no Envoy)"
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
    bench_predict.add_argument("--json", action="store_true", help="print the report as JSON")
    bench_predict.add_argument("--json-out", help="also write the report here")
    bench_predict.set_defaults(func=cmd_bench_predict)
    bench_observe = bench_sub.add_parser(
        "observe",
        help="what tracing and the prediction log cost (a mesh with them against one "
        "without, interleaved), and how soon a sampled trace can be read",
    )
    bench_observe.add_argument("--spec")
    bench_observe.add_argument("--concurrency", type=int, default=64)
    bench_observe.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    bench_observe.add_argument("--repeats", type=int, default=3, help="measurements per mesh")
    bench_observe.add_argument(
        "--probes", type=int, default=10, help="sampled Predicts timed to their trace, per phase"
    )
    bench_observe.add_argument(
        "--split", action="store_true", help="also a mesh with tracing only, one with the log only"
    )
    bench_observe.add_argument("--json-out", help="also write the report here")
    bench_observe.set_defaults(func=cmd_bench_observe)
    bench_profile = bench_sub.add_parser(
        "profile",
        help="sample every Python service with py-spy under Predict load: top frames per kind",
    )
    bench_profile.add_argument("--spec")
    bench_profile.add_argument("--concurrency", type=int, default=64)
    bench_profile.add_argument("--seconds", type=float, default=8.0, help="sampled, under load")
    bench_profile.add_argument("--rate", type=int, default=100, help="samples a second")
    bench_profile.add_argument("--top", type=int, default=10, help="frames shown per kind")
    bench_profile.add_argument("--out", help="where the raw stacks go (default: a temp dir)")
    bench_profile.add_argument("--json-out", help="also write the report here")
    bench_profile.set_defaults(func=cmd_bench_profile)
    bench_model = bench_sub.add_parser(
        "model",
        help="the model server (adaptive, fixed window, batching off) vs echo and in-process",
    )
    bench_model.add_argument("--quick", action="store_true", help="1.5 s per measurement")
    bench_model.add_argument("--seconds", type=float, help="per measurement (default 4)")
    bench_model.add_argument("--rate", type=float, help="open-loop req/s (default 1600)")
    bench_model.add_argument("--concurrency", type=int, nargs="+", help="default: 1 16 64")
    bench_model.add_argument("--server-cpu", type=int, default=0)
    bench_model.add_argument("--client-cpu", type=int, default=1)
    bench_model.add_argument("--no-pin", action="store_true", help="do not pin to CPUs")
    bench_model.add_argument("--json-out", help="also write the report here")
    bench_model.add_argument("--json", action="store_true", help="print the report as JSON")
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
    bench_model.set_defaults(func=cmd_bench_model)
    bench_stream = bench_sub.add_parser(
        "stream",
        help="streaming predictions: events/s end to end and p99 event-to-prediction latency "
        "at a fixed input rate, through the mesh and in process",
    )
    bench_stream.add_argument("--spec")
    bench_stream.add_argument("--rate", type=float, default=500.0, help="input events/s")
    bench_stream.add_argument("--seconds", type=float, default=10.0, help="per round")
    bench_stream.add_argument("--repeats", type=int, default=3, help="rounds per mode")
    bench_stream.add_argument("--batch-size", type=int, default=64, help="events per read")
    bench_stream.add_argument("--json", action="store_true", help="print the report as JSON")
    bench_stream.add_argument("--json-out", help="also write the report here")
    bench_stream.set_defaults(func=cmd_bench_stream)
    bench_batch = bench_sub.add_parser(
        "batch",
        help="batch scoring in process: rows/s of the whole run against the model alone in a "
        "tight loop on the same rows, for the demo and the wine example's models",
    )
    bench_batch.add_argument("--rows", type=int, default=20_000, help="entities per view")
    bench_batch.add_argument(
        "--batch-size", type=int, nargs="+", default=[64, 1024], help="rows per call of the model"
    )
    bench_batch.add_argument(
        "--chunk-rows", type=int, help="rows per read, write and checkpoint (default 16384)"
    )
    bench_batch.add_argument("--repeats", type=int, default=3, help="rounds per row")
    bench_batch.add_argument("--threads", type=int, help="torch intra-op threads")
    bench_batch.add_argument("--json", action="store_true", help="print the report as JSON")
    bench_batch.add_argument("--json-out", help="also write the report here")
    bench_batch.set_defaults(func=cmd_bench_batch)
