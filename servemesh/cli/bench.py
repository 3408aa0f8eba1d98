"""`servemesh bench predict|observe|profile|model|stream|batch|scale|layout`: benchmarks,
each on a mesh of its own (batch: a registry and a Redis of its own)."""

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
            freshness=args.freshness,
        )

    return bench_main(
        args.spec,
        args.concurrency,
        args.seconds,
        args.json_out,
        repeats=args.repeats,
        as_json=args.json,
        direct=args.direct,
        idle_s=args.idle_seconds,
        model=args.model,
        tls_cost=args.tls_cost,
        client=args.client,
        connections=args.connections,
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
        model=args.model,
        client=args.client,
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
    if args.through_mesh:
        from servemesh.batch_mesh_bench import main as bench_during_batch_main

        return bench_during_batch_main(
            args.spec,
            entities=args.rows or 400_000,
            concurrency=args.concurrency,
            seconds=args.seconds,
            repeats=args.repeats,
            batch_size=(args.batch_size or [256])[0],
            json_out=args.json_out,
            as_json=args.json,
        )
    from servemesh.batch_bench import main as bench_batch_main

    return bench_batch_main(
        rows=args.rows or 20_000,
        batch_sizes=args.batch_size or [64, 1024],
        repeats=args.repeats,
        threads=args.threads,
        json_out=args.json_out,
        as_json=args.json,
        chunk_rows=args.chunk_rows,
    )


def cmd_bench_scale(args: argparse.Namespace) -> int:
    from servemesh.scale_bench import main as bench_scale_main

    return bench_scale_main(
        args.spec,
        low=args.low,
        high=args.high,
        seconds=args.seconds,
        slo_ms=args.slo_ms,
        min_replicas=args.min,
        max_replicas=args.max,
        cold_repeats=args.cold_repeats,
        json_out=args.json_out,
        as_json=args.json,
    )


def cmd_bench_layout(args: argparse.Namespace) -> int:
    from servemesh.layout_bench import main as bench_layout_main

    return bench_layout_main(
        args.spec,
        arms=args.arms,
        repeats=args.repeats,
        idle_s=args.idle_seconds,
        seconds=args.seconds,
        concurrency=args.concurrency,
        json_out=args.json_out,
        as_json=args.json,
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
    bench_predict.add_argument(
        "--idle-seconds",
        type=float,
        default=20.0,
        help="the mesh's idle CPU is read over this long, before the load (default 20)",
    )
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
    bench_model.add_argument(
        "--model",
        choices=["demo", "heavy"],
        default="demo",
        help="demo: the demo MLP, protocol-bound (default); heavy: a 2048-wide MLP exported "
        "with torch.export, compute-bound (closed loops, mean batch formed)",
    )
    bench_model.add_argument(
        "--client",
        choices=["python", "h2load"],
        default="python",
        help="python: the asyncio gRPC client (default); h2load: nghttp2's C client sending "
        "one pre-built request, closed loops only (apt-get install nghttp2-client)",
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
    bench_batch.add_argument(
        "--seconds", type=float, default=6.0, help="--through-mesh: per measurement"
    )
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
    bench_batch.add_argument("--json", action="store_true", help="print the report as JSON")
    bench_batch.add_argument("--json-out", help="also write the report here")
    bench_batch.set_defaults(func=cmd_bench_batch)
    bench_scale = bench_sub.add_parser(
        "scale",
        help="an open-loop ramp against fixed min, fixed max and autoscaled model servers in "
        "one run: p99 per window, failed calls, replica-seconds; and cold start with and "
        "without a warm standby",
    )
    bench_scale.add_argument("--spec")
    bench_scale.add_argument("--low", type=float, default=20.0, help="req/s at both ends")
    bench_scale.add_argument("--high", type=float, default=300.0, help="req/s at the top")
    bench_scale.add_argument("--seconds", type=float, default=90.0, help="the whole ramp")
    bench_scale.add_argument("--slo-ms", type=float, default=100.0, help="the p99 SLO")
    bench_scale.add_argument("--min", type=int, default=1, help="replicas (fixed min, start)")
    bench_scale.add_argument("--max", type=int, default=3, help="replicas (fixed max, ceiling)")
    bench_scale.add_argument(
        "--cold-repeats", type=int, default=2, help="scale-ups timed per kind (standby, cold)"
    )
    bench_scale.add_argument("--json", action="store_true", help="print the report as JSON")
    bench_scale.add_argument("--json-out", help="also write the report here")
    bench_scale.set_defaults(func=cmd_bench_scale)
    bench_layout = bench_sub.add_parser(
        "layout",
        help="the mesh's shapes against each other in one run (one shared Envoy, an Envoy "
        "per zone, the small-host profile): start-up, memory and idle CPU of every process, "
        "Predict p50 and req/s",
    )
    bench_layout.add_argument("--spec")
    bench_layout.add_argument(
        "--arms",
        nargs="+",
        # servemesh.layout_bench.ARMS and DEFAULT_ARMS (not imported here: it loads the
        # launcher, which every other command would then pay for at start).
        choices=("shared", "per_zone", "small-host"),
        default=["shared", "per_zone"],
        help="the shapes compared, each against the first (default: shared per_zone)",
    )
    bench_layout.add_argument("--repeats", type=int, default=3, help="meshes per arm")
    bench_layout.add_argument(
        "--idle-seconds", type=float, default=10.0, help="idle CPU read over this long"
    )
    bench_layout.add_argument("--seconds", type=float, default=4.0, help="per Predict round")
    bench_layout.add_argument(
        "--concurrency", type=int, default=16, help="callers of the req/s round (default 16)"
    )
    bench_layout.add_argument("--json", action="store_true", help="print the report as JSON")
    bench_layout.add_argument("--json-out", help="also write the report here")
    bench_layout.set_defaults(func=cmd_bench_layout)
