"""`servemesh predict`: call Predict through the edge of the running mesh (or --address)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import grpc

from servemesh.cli.flags import add_duration, add_output
from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out, write
from servemesh.contract.errors import ServemeshError, UsageError
from servemesh.contract.wire import AUTHORIZATION_HEADER, TENSOR_VALUE_FIELDS, TRACE_HEADERS
from servemesh.identity import OPERATOR_IDENTITY, Dial, across_edges, dial_edges
from servemesh.identity.edge_client import dial_edge_as
from servemesh.identity.tokens import mint_token
from servemesh.spec import MeshSpec, load_spec
from servemesh.state.credentials import authorization_value, read_edge_credentials
from servemesh.state.paths import MeshPaths, NoRunningMesh
from servemesh.tracestore.traceparent import new_traceparent


def _edge_dial(spec: MeshSpec, addresses: list[str], as_operator: bool = False) -> Dial:
    """How to reach the edges: as the running mesh serves them (TLS or not) when one runs on
    this state dir, else as `spec` says; with the operator's certificate when asked. Every
    edge at once, as callers are meant to (across_edges)."""
    try:
        spec = MeshPaths(Path(spec.state_dir)).running_spec()
    except NoRunningMesh:
        pass
    if as_operator:
        return across_edges(dial_edge_as(spec, addresses[0], OPERATOR_IDENTITY), addresses)
    return dial_edges(spec, addresses)


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


def _edge(args: argparse.Namespace) -> tuple[list[str], MeshSpec]:
    """The edges' addresses and the spec to dial them with: the running mesh's (its
    endpoints and TLS), or with --address (one or several, comma-separated) the --spec's
    (a mesh this state dir does not run)."""
    if args.address is None:
        mesh = running_mesh(args)
        endpoints = mesh.endpoints()
        edges = endpoints.get("edges") or [endpoints.get("edge") or mesh.spec.edge_address]
        return [str(edge) for edge in edges], mesh.spec
    spec = load_spec(args.spec)
    if args.state_dir:
        spec = spec.model_copy(update={"state_dir": args.state_dir})
    addresses = [a.strip() for a in str(args.address).split(",") if a.strip()]
    if not addresses:
        raise UsageError("--address: give host:port (several edges: comma-separated)")
    return addresses, spec


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

    for field in TENSOR_VALUE_FIELDS:
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
    from servemesh.predlog.record import tier_name
    from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    rows = []
    for text in args.row or []:
        try:
            rows.append(gateway_pb2.FeatureRow(values=[float(v) for v in text.split(",")]))
        except ValueError:
            bad = f"--row {text[:40]!r}: not a comma-separated list of numbers"
            raise UsageError(bad) from None
    try:
        entities = [_parse_entity(text) for text in args.entity or []]
        inputs = _input_tensors(args.input or [])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    request = gateway_pb2.PredictRequest(
        model=args.model, rows=rows, version=args.version or "", inputs=inputs
    )
    named = [e for e in entities if isinstance(e, dict)]
    if named and len(named) != len(entities):
        # A bare id cannot say which entity it is once the others are named.
        raise UsageError("--entity: name every entity (name=id) or none")
    request.entities.extend(gateway_pb2.EntityRow(ids=ids) for ids in named)
    request.entity_ids.extend(e for e in entities if isinstance(e, str))
    addresses, spec = _edge(args)
    try:
        metadata = _edge_auth_metadata(args, spec)
    except OSError as exc:
        raise ServemeshError(f"--token-file: cannot read: {exc.strerror}") from None
    trace_id = None
    if args.trace:
        traceparent, trace_id = new_traceparent()
        metadata.append((TRACE_HEADERS[0], traceparent))
    try:
        plan = _edge_dial(spec, addresses, args.as_operator)
    except ValueError as exc:
        raise UsageError(f"--address: {exc}") from None
    with plan.channel() as channel:
        try:
            reply = gateway_pb2_grpc.GatewayStub(channel).Predict(
                request, timeout=args.timeout, metadata=metadata
            )
        except grpc.RpcError as exc:
            raise ServemeshError(f"{exc.code().name}: {exc.details()}") from None
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
            # Which tier answered: "online" (the model), "cache" or "precomputed" (docs/tiers.md).
            "tier": tier_name(reply.tier),
            **({"trace_id": trace_id} if trace_id else {}),
        }
        write(json.dumps(answer))
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
    if reply.tier != gateway_pb2.TIER_ONLINE:
        # The model did not run for this call: a tier answered (docs/tiers.md).
        out.print(f"answered by: the {tier_name(reply.tier)} tier", markup=False)
    out.print(f"request id: {reply.request_id}")
    if trace_id:
        out.print(f"trace id: {trace_id}  (servemesh trace {reply.request_id})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
    predict.add_argument(
        "--address",
        help="edge address, or every edge's comma-separated (default: the running mesh's "
        "edges; then no mesh is needed)",
    )
    add_mesh_flags(predict)
    add_duration(
        predict, "--timeout", "the call's deadline (default 5s)", dest="timeout", default=5.0
    )
    add_output(predict, "print the answer as JSON")
    predict.add_argument(
        "--trace", action="store_true", help="force a trace of this call (prints its trace id)"
    )
    predict.set_defaults(func=cmd_predict)
