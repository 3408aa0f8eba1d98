"""The servemesh command line: run the mesh, call it, check a spec."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.table import Table

from servemesh.apply_cli import add_apply_parser
from servemesh.auth_cli import add_auth_parser
from servemesh.auth_cli import mint as mint_token
from servemesh.certs_cli import add_certs_parser
from servemesh.chaos.cli import add_chaos_parser
from servemesh.compose_cli import add_compose_parsers
from servemesh.credentials import authorization_value, read_edge_credentials
from servemesh.features.cli import add_features_parser
from servemesh.fuzz.cli import add_fuzz_parser
from servemesh.identity import OPERATOR_IDENTITY, Dial, dial_edge_at
from servemesh.identity.edge_client import dial_edge_as
from servemesh.identity.tokens import TokenError
from servemesh.load_cli import add_load_parser
from servemesh.log_cli import add_log_parser
from servemesh.models_cli import add_models_parser
from servemesh.observe.top import add_top_parser
from servemesh.proxy.apply import MeshPaths, NoRunningMesh
from servemesh.rollout.cli import add_rollout_parser
from servemesh.rollout.fleet_cli import add_fleet_parser
from servemesh.routes_cli import add_routes_parser
from servemesh.spec import MeshSpec, SpecError, load_spec
from servemesh.tracestore.cli import add_trace_parser, new_traceparent
from servemesh.wire import AUTHORIZATION_HEADER, TRACE_HEADERS

console = Console(stderr=True)
out = Console()


def _load(path: str | None) -> MeshSpec:
    try:
        return load_spec(path)
    except SpecError as exc:
        console.print(f"[red]{exc}[/red]")
        raise SystemExit(2) from None


def cmd_up(args: argparse.Namespace) -> int:
    from servemesh.launcher import Mesh
    from servemesh.procs import StartError

    spec = _load(args.spec)
    if args.netns:
        network = spec.network.model_copy(update={"mode": "netns"})
        spec = spec.model_copy(update={"network": network})
    mesh = Mesh.from_spec(spec, Path(args.state_dir) if args.state_dir else None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = time.perf_counter()
    with console.status(
        "starting the mesh (Redis, registry, models, features, gateways, Envoy)..."
    ):
        try:
            mesh.start()
        except StartError as exc:
            console.print(f"[red]the mesh did not start:[/red] {exc}")
            return 1
    elapsed = time.perf_counter() - started
    table = Table(title=f"servemesh is up ({elapsed:.1f} s)", title_justify="left")
    table.add_column("endpoint")
    table.add_column("address")
    table.add_column("pid", justify="right")
    endpoints = mesh.endpoints()
    pids = mesh.pids()
    table.add_row("edge (clients, grpcurl)", str(endpoints["edge"]), str(pids.get("envoy", "")))
    for zone in mesh.spec.zones:
        table.add_row(f"mesh listener of {zone}", mesh.spec.mesh_address_for(zone), "")
    # A Unix socket (curl --unix-socket PATH http://localhost/...), not a TCP port.
    table.add_row("envoy admin", f"unix:{endpoints['envoy_admin']}", "")
    table.add_row("redis", str(endpoints["redis"]), str(pids.get("redis", "")))
    if endpoints.get("trace_store"):
        # `servemesh trace` reads what it stores; a collector of the spec's when no pid.
        table.add_row(
            "trace store (OTLP)", str(endpoints["trace_store"]), str(pids.get("tracestore", ""))
        )
    for inst in mesh.spec.instances():
        table.add_row(inst.name, mesh.spec.address_of(inst.name), str(pids.get(inst.name, "")))
    out.print(table)
    out.print(f"logs: {endpoints['logs']}")
    out.print(f"try:  {sys.argv[0]} predict --model fraud --entity user-42")
    out.print("Ctrl-C stops the mesh")
    sys.stdout.flush()
    try:
        while not stop.wait(0.5):
            for child in mesh.reap_exited():
                console.print(f"[yellow]{child.name} exited with {child.returncode}[/yellow]")
    finally:
        with console.status("stopping..."):
            mesh.stop()
    out.print("stopped")
    return 0


def _edge_dial(spec: MeshSpec, address: str, as_operator: bool = False) -> Dial:
    """How to reach the edge: as the running mesh serves it (TLS or not) when one runs on
    this state dir, else as `spec` says; with the operator's certificate when asked."""
    try:
        spec = MeshPaths(Path(spec.state_dir)).running_spec()
    except NoRunningMesh:
        pass
    if as_operator:
        return dial_edge_as(spec, address, OPERATOR_IDENTITY)
    return dial_edge_at(spec, address)


# A token `predict` signs for itself (jwt mode, the mesh's key readable, none given).
CLI_TOKEN_TTL_S = 300.0


def _edge_auth_metadata(args: argparse.Namespace, spec: MeshSpec) -> list[tuple[str, str]]:
    """The credentials `predict` sends at the edge: a token (--token, --token-file, else one
    signed for this call when the mesh's key is readable) in jwt mode, the mesh's basic
    credentials in basic mode."""
    try:
        spec = MeshPaths(Path(spec.state_dir)).running_spec()
    except NoRunningMesh:
        pass
    token = args.token
    if token is None and args.token_file:
        token = Path(args.token_file).read_text().strip()
    if token is None and spec.traffic.edge_auth.active_mode == "jwt":
        roles = spec.traffic.edge_auth.roles
        role = "operator" if args.as_operator and "operator" in roles else roles[0]
        token = mint_token(spec, role, "servemesh-cli", CLI_TOKEN_TTL_S)
    if token:
        return [(AUTHORIZATION_HEADER, f"Bearer {token}")]
    credentials = read_edge_credentials(Path(spec.state_dir))
    if credentials is not None:
        return [(AUTHORIZATION_HEADER, authorization_value(*credentials))]
    return []


def _edge_address(args: argparse.Namespace) -> str:
    if args.address:
        return args.address
    spec = _load(args.spec)
    endpoints = Path(args.state_dir or spec.state_dir) / "endpoints.json"
    if endpoints.is_file():
        return str(json.loads(endpoints.read_text())["edge"])
    if not spec.ports.edge:
        raise SystemExit(
            f"no running mesh under {endpoints.parent} and no fixed edge port: give --address"
        )
    return f"{spec.host}:{spec.ports.edge}"


def _parse_entity(text: str) -> dict[str, str] | str:
    """`--entity`: `user-42` (the model's only entity) or `lot=L-17,merchant=m-3`."""
    if "=" not in text:
        return text
    ids: dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"--entity {text[:60]!r}: give name=id[,name=id]")
        ids[name.strip()] = value.strip()
    return ids


def _parse_input(text: str) -> tuple[str, list[int] | list[float]]:
    """`--input NAME=v1,v2,...`: one row of a raw input. Whole numbers travel as integers
    (exact for INT64 ids), anything else as doubles; the gateway converts them to the
    datatype the model takes, refusing a value it cannot hold."""
    name, sep, values = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--input {text[:60]!r}: give NAME=v1,v2,...")
    tokens = [v.strip() for v in values.split(",")]
    try:
        return name.strip(), [int(v) for v in tokens]
    except ValueError:
        pass
    try:
        return name.strip(), [float(v) for v in tokens]
    except ValueError:
        raise ValueError(f"--input {text[:60]!r}: not a comma-separated list of numbers") from None


def _input_tensors(texts: list[str]) -> dict[str, Any]:
    """The raw inputs of --input flags, by name: each flag one row, in order."""
    from servemesh_api.gateway.v1 import gateway_pb2

    rows: dict[str, list[list[int] | list[float]]] = {}
    for text in texts:
        name, row = _parse_input(text)
        rows.setdefault(name, []).append(row)
    tensors = {}
    for name, values in rows.items():
        widths = {len(row) for row in values}
        if len(widths) != 1:
            raise ValueError(
                f"--input {name}: every row needs as many values, got {sorted(widths)}"
            )
        flat = [v for row in values for v in row]
        tensor = gateway_pb2.Tensor(shape=[len(values), widths.pop()])
        if all(isinstance(v, int) for v in flat):
            tensor.int64_values.extend(int(v) for v in flat)
        else:
            tensor.double_values.extend(float(v) for v in flat)
        tensors[name] = tensor
    return tensors


def _tensor_rows(tensor: Any) -> list[Any]:
    """A public Tensor's values as nested lists, one per row."""
    import numpy as np

    for field in (
        "float_values",
        "double_values",
        "int64_values",
        "int_values",
        "uint64_values",
        "uint_values",
        "bool_values",
    ):
        values = getattr(tensor, field)
        if len(values):
            rows: list[Any] = (
                np.asarray(list(values), dtype=object).reshape(list(tensor.shape)).tolist()
            )
            return rows
    return [[] for _ in range(tensor.shape[0] if tensor.shape else 0)]


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.6f}"
    return str(value)


def cmd_predict(args: argparse.Namespace) -> int:
    from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    rows = []
    for text in args.row or []:
        try:
            rows.append(gateway_pb2.FeatureRow(values=[float(v) for v in text.split(",")]))
        except ValueError:
            console.print(f"[red]--row {text[:40]!r}: not a comma-separated list of numbers[/red]")
            return 2
    try:
        entities = [_parse_entity(text) for text in args.entity or []]
        inputs = _input_tensors(args.input or [])
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    request = gateway_pb2.PredictRequest(
        model=args.model, rows=rows, version=args.version or "", inputs=inputs
    )
    named = [e for e in entities if isinstance(e, dict)]
    if named and len(named) != len(entities):
        # A bare id cannot say which entity it is once the others are named.
        console.print("[red]--entity: name every entity (name=id) or none[/red]")
        return 2
    request.entities.extend(gateway_pb2.EntityRow(ids=ids) for ids in named)
    request.entity_ids.extend(e for e in entities if isinstance(e, str))
    address = _edge_address(args)
    metadata = []
    spec = _load(args.spec)
    if args.state_dir:
        spec = spec.model_copy(update={"state_dir": args.state_dir})
    try:
        metadata += _edge_auth_metadata(args, spec)
    except (TokenError, OSError) as exc:
        console.print(str(exc), style="red", markup=False, highlight=False)
        return 2
    trace_id = None
    if args.trace:
        traceparent, trace_id = new_traceparent()
        metadata.append((TRACE_HEADERS[0], traceparent))
    with _edge_dial(spec, address, args.as_operator).channel() as channel:
        try:
            reply = gateway_pb2_grpc.GatewayStub(channel).Predict(
                request, timeout=args.timeout, metadata=metadata
            )
        except grpc.RpcError as exc:
            console.print(f"[red]{exc.code().name}[/red]: {exc.details()}")
            return 1
    outputs = {name: reply.outputs[name] for name in sorted(reply.outputs)}
    if args.json:
        answer = {
            "outputs": {
                name: {
                    "datatype": tensor.datatype,
                    "shape": list(tensor.shape),
                    "values": _tensor_rows(tensor),
                }
                for name, tensor in outputs.items()
            },
            "scores": list(reply.scores),
            "model_version": reply.model_version,
            "degraded": reply.degraded,
            "degraded_reason": reply.degraded_reason,
            "request_id": reply.request_id,
            **({"trace_id": trace_id} if trace_id else {}),
        }
        sys.stdout.write(json.dumps(answer) + "\n")
        return 0
    labels = [
        e if isinstance(e, str) else ",".join(f"{k}={v}" for k, v in e.items()) for e in entities
    ]
    labels += [f"row {i}" for i in range(len(rows))]
    n_rows = len(reply.scores) or max((t.shape[0] for t in outputs.values() if t.shape), default=0)
    labels += [f"row {i}" for i in range(len(labels), n_rows)]
    per_output = {name: _tensor_rows(tensor) for name, tensor in outputs.items()}
    for i, label in enumerate(labels[:n_rows]):
        if not outputs:  # a fallback: its scores alone
            out.print(f"{label}: score {reply.scores[i]:.6f}", markup=False)
            continue
        shown = []
        for name, values in per_output.items():
            value = values[i]
            # One number per row ([n] or [n, 1]) reads as a number.
            if isinstance(value, list) and len(value) == 1:
                value = value[0]
            shown.append(f"{name} {_shown(value)}")
        out.print(f"{label}: " + "  ".join(shown), markup=False)
    out.print(
        f"model version: {reply.model_version}"
        + ("  [yellow](degraded)[/yellow]" if reply.degraded else "")
    )
    if reply.degraded_reason:
        out.print(f"degraded: {reply.degraded_reason}", markup=False)
    out.print(f"request id: {reply.request_id}")
    if trace_id:
        out.print(f"trace id: {trace_id}  (servemesh trace {reply.request_id})")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Validate a spec: the typed model, then the rendered Envoy config by Envoy itself."""
    from servemesh.proxy.offline import validate_offline
    from servemesh.proxy.process import EnvoyConfigError
    from servemesh.spec import resolve

    spec = resolve(_load(args.spec))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            validate_offline(spec, Path(tmp))
        except EnvoyConfigError as exc:
            console.print(f"[red]Envoy refuses the rendered config:[/red]\n{exc}")
            return 1
    out.print(f"ok: {args.spec or 'built-in defaults'} is valid and renders a config Envoy accepts")
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    import yaml

    from servemesh.proxy.render import render_resources, static_bootstrap
    from servemesh.spec import resolve

    spec = resolve(_load(args.spec))
    logs = Path(spec.state_dir) / "logs"
    config = static_bootstrap(spec, render_resources(spec, logs), logs)
    # Plain stdout: rich would wrap long lines and read [brackets] as markup.
    sys.stdout.write(yaml.safe_dump(config, sort_keys=False))
    return 0


def cmd_bench_predict(args: argparse.Namespace) -> int:
    from servemesh.bench import main as bench_main

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servemesh", description="A gRPC serving mesh for PyTorch models"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the whole mesh and keep it running until Ctrl-C")
    up.add_argument("--spec", help="mesh spec (default: ./mesh.yaml, else built-in defaults)")
    up.add_argument("--state-dir", help="where logs, the registry and rendered config go")
    up.add_argument(
        "--netns",
        action="store_true",
        help="run each zone's services in a network namespace of its own (root; partitions): "
        "sets the spec's network.mode to netns",
    )
    up.set_defaults(func=cmd_up)

    predict = sub.add_parser("predict", help="call Predict through the edge")
    predict.add_argument("--model", required=True)
    predict.add_argument(
        "--entity",
        action="append",
        help="one row's entity ids: name=id[,name=id], or a bare id for a model of one "
        "entity (repeatable, one row each)",
    )
    predict.add_argument(
        "--input",
        action="append",
        metavar="NAME=v1,v2,...",
        help="one row of a raw input tensor (repeatable, one row each, in order)",
    )
    predict.add_argument(
        "--row", action="append", help="comma-separated feature values (repeatable)"
    )
    predict.add_argument(
        "--version",
        help="pin a model version (one at 0%% of traffic: operators only, see --as-operator)",
    )
    predict.add_argument(
        "--token",
        help="an edge token (servemesh auth token); default in jwt mode: one signed "
        "for this call with the mesh's key, when readable",
    )
    predict.add_argument("--token-file", help="a file holding an edge token")
    predict.add_argument(
        "--as-operator",
        action="store_true",
        help="present the operator's certificate at the edge (and sign an operator token)",
    )
    predict.add_argument("--address", help="edge address (default: the running mesh's)")
    predict.add_argument("--spec")
    predict.add_argument("--state-dir", help="the running mesh's state dir (edge credentials)")
    predict.add_argument("--timeout", type=float, default=5.0, help="deadline in seconds")
    predict.add_argument("--json", action="store_true", help="print the answer as JSON")
    predict.add_argument(
        "--trace", action="store_true", help="force a trace of this call (prints its trace id)"
    )
    predict.set_defaults(func=cmd_predict)

    check = sub.add_parser("check", help="validate a mesh spec and the Envoy config it renders")
    check.add_argument("spec", nargs="?")
    check.set_defaults(func=cmd_check)

    add_routes_parser(sub)
    add_load_parser(sub)
    add_fleet_parser(sub)
    add_rollout_parser(sub)
    add_apply_parser(sub)
    add_models_parser(sub)
    add_certs_parser(sub)
    add_auth_parser(sub)
    add_chaos_parser(sub)
    add_features_parser(sub)
    add_fuzz_parser(sub)
    add_top_parser(sub)
    add_log_parser(sub)
    add_trace_parser(sub)
    add_compose_parsers(sub)

    envoy = sub.add_parser("envoy-config", help="print the Envoy config a spec renders")
    envoy.add_argument("--spec")
    envoy.set_defaults(func=cmd_envoy_config)

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = int(args.func(args))
    if getattr(args, "exit_without_teardown", False):
        # A command whose native libraries can abort at interpreter teardown (see
        # `features load`): its output flushed, the process ends here with its code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
