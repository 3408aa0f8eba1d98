"""`servemesh models ...`: push a model version (checked and probed first), list, show, alias.

The commands talk to the running mesh: its registry's address (and the model servers')
come from `<state dir>/mesh.resolved.yaml`, the state dir from `--state-dir` or the spec
(default `.servemesh`), and live weights from Envoy's admin API, as `servemesh routes` reads
them. `push` refuses, with one line naming the problem and nothing uploaded, a file that is
not a model, a damaged or hostile archive, one over the mesh's artifact limit, a signature
that is missing or disagrees with the program, and a model whose answer to one probe batch
(two rows: zeros, then ones) does not keep its signature.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from rich.table import Table
from rich.text import Text

from servemesh.cli import mesh as found_mesh
from servemesh.cli import quarantine
from servemesh.cli.flags import add_gate_overrides, add_output
from servemesh.cli.gates import report_gates
from servemesh.cli.mesh import add_mesh_flags
from servemesh.cli.output import out, write
from servemesh.contract.control_credential import (
    ControlCredentialMissing,
    Metadata,
    control_metadata_for,
)
from servemesh.contract.errors import ServemeshError
from servemesh.contract.wire import message_size_options
from servemesh.identity import dial_registry, dial_service
from servemesh.proxy.admin import AdminError
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_view import live_view
from servemesh.registry.client import push_version, set_alias
from servemesh.registry.errors import InvalidArgumentError
from servemesh.registry.records import TensorSpec
from servemesh.registry.validation import (
    check_labels,
    check_lineage,
    check_metrics,
    check_name,
    check_tensor_specs,
)
from servemesh.rollout.change_gates import enforce, overrides_from, record_if_overridden
from servemesh.services.model.tensors import Signature, TensorSig
from servemesh.spec import ResolvedSpec
from servemesh.state.paths import ApplyError, MeshPaths
from servemesh.state.running import RunningMesh
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

RPC_TIMEOUT_S = 10.0
REPLICA_TIMEOUT_S = 2.0
UPLOAD_TIMEOUT_S = 600.0


class ModelsError(ServemeshError):
    """The command was refused or failed; the message is one line naming why."""


# --- the running mesh --------------------------------------------------------------------


def registry_channel(mesh: RunningMesh) -> grpc.aio.Channel:
    return dial_registry(mesh.spec).aio_channel(
        options=message_size_options(mesh.spec.limits.max_message_bytes)
    )


def credential(mesh: RunningMesh) -> Metadata:
    """The control call metadata of this mesh (pushes and aliases are control calls)."""
    try:
        return control_metadata_for(mesh.state_dir)
    except ControlCredentialMissing as exc:
        raise ModelsError(_one_line(str(exc))) from None


def running_mesh(args: argparse.Namespace) -> RunningMesh:
    """The mesh the command's flags point at (servemesh/cli/mesh.py)."""
    return found_mesh.running_mesh(args)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _rpc_error(what: str, exc: grpc.aio.AioRpcError) -> ModelsError:
    return ModelsError(_one_line(f"{what}: {exc.code().name}: {exc.details()}"))


# --- push --------------------------------------------------------------------------------


def _pairs(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ModelsError(f"{flag} {item[:60]!r}: expected KEY=VALUE")
        if key in pairs:
            raise ModelsError(f"{flag} {key}: given twice")
        pairs[key] = value
    return pairs


def _metrics(items: Sequence[str] | None) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for key, value in _pairs(items, "--metric").items():
        try:
            number = float(value)
        except ValueError:
            raise ModelsError(f"--metric {key}: {value[:40]!r} is not a number") from None
        if not math.isfinite(number):
            raise ModelsError(f"--metric {key}: {value[:40]!r} is not a finite number")
        metrics[key] = number
    return metrics


def read_signature(path: Path) -> Signature:
    """A signature file: `inputs:` and `outputs:`, each a list of name, datatype, shape."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ModelsError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ModelsError(_one_line(f"{path}: malformed YAML: {exc}")) from None
    if not isinstance(data, dict) or set(data) - {"inputs", "outputs"}:
        raise ModelsError(f"{path}: expected a mapping with `inputs:` and `outputs:` lists")
    specs: dict[str, tuple[TensorSpec, ...]] = {}
    for kind in ("inputs", "outputs"):
        items = data.get(kind)
        if not isinstance(items, list):
            raise ModelsError(f"{path}: {kind}: expected a list of name, datatype, shape")
        parsed = []
        for index, item in enumerate(items):
            if (
                not isinstance(item, dict)
                or set(item) != {"name", "datatype", "shape"}
                or not isinstance(item["shape"], list)
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in item["shape"])
            ):
                raise ModelsError(
                    f"{path}: {kind}[{index}]: expected name, datatype and shape (a list of "
                    "ints, -1 first for the batch dim)"
                )
            parsed.append(
                TensorSpec(str(item["name"]), str(item["datatype"]), tuple(item["shape"]))
            )
        specs[kind] = tuple(parsed)
    try:
        check_tensor_specs(specs["inputs"], f"{path}: inputs")
        check_tensor_specs(specs["outputs"], f"{path}: outputs")
        return Signature.from_specs(specs["inputs"], specs["outputs"], where=str(path))
    except InvalidArgumentError as exc:
        raise ModelsError(exc.message) from None
    except ValueError as exc:
        raise ModelsError(str(exc)) from None


@dataclass(frozen=True)
class PushRequest:
    file: Path
    model: str
    version: str
    signature: Path | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    lineage: Mapping[str, str] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Pushed:
    record: registry_pb2.ModelVersion
    signature: Signature
    probe_shapes: dict[str, list[int]]


def check_push(
    request: PushRequest, limit_bytes: int
) -> tuple[bytes, str, Signature, dict[str, list[int]]]:
    """Everything `push` checks before a byte leaves: (data, format, signature, probe shapes).

    Raises ModelsError naming the first problem.
    """
    # The model runs in a sandboxed child (servemesh.sandbox): a model file is code, and
    # this process may hold the operator's credentials.
    from servemesh.sandbox.model import (
        ModelCrashed,
        ModelFailed,
        ModelRefused,
        SandboxedModel,
        SandboxedModelError,
    )

    try:
        check_name(request.model, "--model")
        check_name(request.version, "--version")
        check_labels(request.labels, "--label")
        check_lineage(request.lineage, "--lineage")
        check_metrics(request.metrics, "--metric")
    except InvalidArgumentError as exc:
        raise ModelsError(exc.message) from None
    name = request.file.name
    try:
        size = request.file.stat().st_size
    except OSError as exc:
        raise ModelsError(f"{request.file}: cannot read: {exc.strerror}") from None
    if size > limit_bytes:
        raise ModelsError(
            f"{name}: {size} bytes is over the mesh's artifact limit of {limit_bytes} bytes "
            "(limits.max_artifact_bytes)"
        )
    declared = read_signature(request.signature) if request.signature else None
    data = request.file.read_bytes()
    try:
        with SandboxedModel.open(
            data, declared=declared, model=request.model, version=request.version,
            max_batch_size=2,
        ) as sandboxed:  # fmt: skip
            answer = sandboxed.probe()
            opened_format, signature = sandboxed.format, sandboxed.signature
    except ModelRefused as exc:
        raise ModelsError(_one_line(f"{name}: {exc}")) from None
    except ModelFailed as exc:
        if exc.kind == "model":
            raise ModelsError(
                _one_line(
                    f"{name}: the model failed on the probe batch (2 rows: zeros, ones): "
                    f"{exc.error}: {exc}"
                )
            ) from None
        raise ModelsError(_one_line(f"{name}: the probe batch: {exc}")) from None
    except ModelCrashed as exc:
        raise ModelsError(_one_line(f"{name}: the probe batch: {exc}")) from None
    except SandboxedModelError as exc:  # pragma: no cover - every kind is named above
        raise ModelsError(_one_line(f"{name}: {exc}")) from None
    assert signature is not None
    shapes = {key: list(value.shape) for key, value in answer.items()}
    return data, opened_format, signature, shapes


async def push(mesh: RunningMesh, request: PushRequest) -> Pushed:
    """Check, probe, then upload `request.file` as model/version with its sha256."""
    data, format, signature, shapes = await asyncio.to_thread(
        check_push, request, mesh.spec.limits.max_artifact_bytes
    )
    async with registry_channel(mesh) as channel:
        try:
            record = await push_version(
                channel,
                model=request.model,
                version=request.version,
                data=data,
                inputs=[_spec(t) for t in signature.inputs],
                outputs=[_spec(t) for t in signature.outputs],
                credential=credential(mesh),
                labels=request.labels,
                lineage=request.lineage,
                metrics=request.metrics,
                format=format,
                timeout=UPLOAD_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(f"the registry at {mesh.spec.registry_address} refused", exc) from None
    return Pushed(record, signature, shapes)


def _spec(sig: TensorSig) -> TensorSpec:
    return TensorSpec(sig.name, sig.datatype, sig.shape)


def cmd_push(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    request = PushRequest(
        file=Path(args.file),
        model=args.model,
        version=args.version,
        signature=Path(args.signature) if args.signature else None,
        labels=_pairs(args.label, "--label"),
        lineage=_pairs(args.lineage, "--lineage"),
        metrics=_metrics(args.metric),
    )
    pushed = asyncio.run(push(mesh, request))
    record = pushed.record
    out.print(
        f"pushed {record.model} {record.version}: {record.format}, {_size(record.size_bytes)}, "
        f"sha256 {record.sha256}",
        highlight=False,
        markup=False,
    )
    probe = ", ".join(f"{name} {shape}" for name, shape in pushed.probe_shapes.items())
    out.print(f"probe: 2 rows (zeros, ones) answered {probe}", highlight=False, markup=False)
    out.print(_signature_table(record))
    out.print(f"registry: {mesh.spec.registry_address}", highlight=False, markup=False)
    return 0


# --- reading what the mesh holds ---------------------------------------------------------


@dataclass
class Holdings:
    """Which replica holds which version, and the live weights Envoy serves."""

    replicas: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    unreachable: list[str] = field(default_factory=list)
    weights: dict[tuple[str, str], int] | None = None  # None: Envoy did not answer
    weights_note: str = ""

    def replicas_of(self, model: str, version: str) -> str:
        return ", ".join(self.replicas.get((model, version), [])) or "-"

    def weight_of(self, model: str, version: str) -> str:
        if self.weights is None:
            return "?"
        weight = self.weights.get((model, version))
        return "-" if weight is None else f"{weight}%"


async def _replica_index(
    spec: ResolvedSpec, instance: str
) -> tuple[str, list[tuple[str, str]] | None]:
    async with dial_service(spec, instance).aio_channel() as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            index = await stub.RepositoryIndex(
                oip.RepositoryIndexRequest(ready=True), timeout=REPLICA_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            return instance, None
    return instance, [(m.name, m.version) for m in index.models]


def _live_weights(mesh: RunningMesh, holdings: Holdings) -> None:
    try:
        manager = RouteManager(MeshPaths(mesh.state_dir))
        rows = live_view(manager.admins(mesh.spec), mesh.spec)
    except (ApplyError, AdminError, OSError, KeyError, ValueError) as exc:
        holdings.weights_note = _one_line(f"live weights unavailable: {exc}")
        return
    holdings.weights = {(row.model, row.version): row.weight for row in rows}


async def holdings(mesh: RunningMesh) -> Holdings:
    """Ask every model server what it holds, and Envoy what weights it serves."""
    found = Holdings()
    replicas = [i.name for i in mesh.spec.instances() if i.service == "model"]
    answers = await asyncio.gather(*(_replica_index(mesh.spec, name) for name in replicas))
    for instance, models in answers:
        if models is None:
            found.unreachable.append(instance)
            continue
        for key in models:
            found.replicas.setdefault(key, []).append(instance)
    await asyncio.to_thread(_live_weights, mesh, found)
    return found


@dataclass
class Catalogue:
    models: list[registry_pb2.Model]
    versions: dict[str, list[registry_pb2.ModelVersion]]


async def catalogue(mesh: RunningMesh) -> Catalogue:
    """Every model and its versions, from the registry."""
    async with registry_channel(mesh) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        try:
            listed = await stub.ListModels(registry_pb2.ListModelsRequest(), timeout=RPC_TIMEOUT_S)
            versions = await asyncio.gather(
                *(
                    stub.ListVersions(
                        registry_pb2.ListVersionsRequest(model=m.name), timeout=RPC_TIMEOUT_S
                    )
                    for m in listed.models
                )
            )
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(f"the registry at {mesh.spec.registry_address}", exc) from None
    return Catalogue(
        list(listed.models),
        {m.name: list(v.versions) for m, v in zip(listed.models, versions, strict=True)},
    )


def _aliases_of(model: registry_pb2.Model, version: str) -> list[str]:
    return sorted(alias for alias, target in model.aliases.items() if target == version)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def _when(unix_ms: int) -> str:
    moment = datetime.datetime.fromtimestamp(unix_ms / 1000, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _version_json(
    model: registry_pb2.Model, record: registry_pb2.ModelVersion, found: Holdings
) -> dict[str, Any]:
    weight = found.weights.get((record.model, record.version)) if found.weights else None
    return {
        "model": record.model,
        "version": record.version,
        "format": record.format,
        "sha256": record.sha256,
        "size_bytes": record.size_bytes,
        "created_unix_ms": record.created_unix_ms,
        "aliases": _aliases_of(model, record.version),
        "labels": dict(record.labels),
        "lineage": dict(record.lineage),
        "metrics": dict(record.metrics),
        "inputs": [_tensor_json(t) for t in record.inputs],
        "outputs": [_tensor_json(t) for t in record.outputs],
        "replicas": found.replicas.get((record.model, record.version), []),
        "weight": weight,
    }


def _tensor_json(spec: registry_pb2.TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


def cmd_list(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)

    async def gather() -> tuple[Catalogue, Holdings]:
        return await asyncio.gather(catalogue(mesh), holdings(mesh))

    listed, found = asyncio.run(gather())
    if args.json:
        rows = [
            _version_json(model, record, found)
            for model in listed.models
            for record in listed.versions[model.name]
        ]
        write(json.dumps(rows))
        return 0
    table = Table(
        title=f"models in the registry ({mesh.spec.registry_address})", title_justify="left"
    )
    for column in ("model", "version", "aliases", "format", "size", "replicas", "weight"):
        table.add_column(column, justify="right" if column in ("size", "weight") else "left")
    for model in listed.models:
        for record in listed.versions[model.name]:
            table.add_row(
                *_cells(
                    model.name,
                    record.version,
                    ", ".join(_aliases_of(model, record.version)) or "-",
                    record.format,
                    _size(record.size_bytes),
                    found.replicas_of(model.name, record.version),
                    found.weight_of(model.name, record.version),
                )
            )
    out.print(table)
    _notes(found)
    return 0


def _cells(*values: str) -> list[Text]:
    """Table cells shown as written: names and labels are not rich markup."""
    return [Text(value) for value in values]


def _notes(found: Holdings) -> None:
    if found.unreachable:
        out.print(f"replicas that did not answer: {', '.join(found.unreachable)}", markup=False)
    if found.weights_note:
        out.print(found.weights_note, highlight=False, markup=False)


def _signature_table(record: registry_pb2.ModelVersion) -> Table:
    table = Table(title="signature", title_justify="left")
    for column in ("", "name", "datatype", "shape"):
        table.add_column(column)
    for kind, tensors in (("input", record.inputs), ("output", record.outputs)):
        for tensor in tensors:
            table.add_row(*_cells(kind, tensor.name, tensor.datatype, str(list(tensor.shape))))
    return table


def _pairs_text(pairs: Mapping[str, Any]) -> str:
    shown = [
        f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in sorted(pairs.items())
    ]
    return ", ".join(shown) or "-"


def cmd_show(args: argparse.Namespace) -> int:
    if args.version is None:  # the model's versions: quarantine and crashes (no registry)
        return quarantine.cmd_show_model(args)
    mesh = running_mesh(args)

    async def gather() -> tuple[Catalogue, registry_pb2.ModelVersion, Holdings]:
        async with registry_channel(mesh) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            try:
                record = await stub.GetVersion(
                    registry_pb2.GetVersionRequest(model=args.model, version=args.version),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                raise _rpc_error(f"the registry at {mesh.spec.registry_address}", exc) from None
        listed, found = await asyncio.gather(catalogue(mesh), holdings(mesh))
        return listed, record, found

    listed, record, found = asyncio.run(gather())
    model = next(m for m in listed.models if m.name == record.model)
    if args.json:
        shown = _version_json(model, record, found)
        shown |= quarantine.version_facts(mesh.state_dir, record.model, record.version)
        write(json.dumps(shown))
        return 0
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    for label, value in (
        ("format", record.format),
        ("sha256", record.sha256),
        ("size", f"{_size(record.size_bytes)} ({record.size_bytes} bytes)"),
        ("created", _when(record.created_unix_ms)),
        ("aliases", ", ".join(_aliases_of(model, record.version)) or "-"),
        ("labels", _pairs_text(record.labels)),
        ("lineage", _pairs_text(record.lineage)),
        ("metrics", _pairs_text(record.metrics)),
        ("replicas", found.replicas_of(record.model, record.version)),
        ("weight", found.weight_of(record.model, record.version)),
    ):
        facts.add_row(*_cells(label, value))
    out.print(f"{record.model} {record.version}", highlight=False, markup=False)
    out.print(facts, highlight=False)
    out.print(_signature_table(record))
    quarantine.version_section(mesh.state_dir, record.model, record.version)
    _notes(found)
    return 0


def cmd_alias(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    # Pointing an alias at another version deploys it wherever the alias is followed: the
    # freeze and error budget gates hold it as they hold a weight move (change_gates).
    gates = enforce(
        RouteManager(mesh.paths).live_spec(),
        [args.model],
        command=f"models alias {args.model} {args.alias}",
        overrides=overrides_from(args.override, args.reason),
    )
    report_gates(gates)

    async def apply() -> tuple[str | None, registry_pb2.Model]:
        async with registry_channel(mesh) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            try:
                listed = await stub.ListModels(
                    registry_pb2.ListModelsRequest(), timeout=RPC_TIMEOUT_S
                )
                before = next((m for m in listed.models if m.name == args.model), None)
                previous = before.aliases.get(args.alias) if before is not None else None
                model = await set_alias(
                    channel,
                    args.model,
                    args.alias,
                    args.version,
                    credential=credential(mesh),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                raise _rpc_error("the registry refused", exc) from None
        return previous, model

    previous, model = asyncio.run(apply())
    record_if_overridden(mesh.state_dir, gates)
    target = model.aliases[args.alias]
    was = f" (was {previous})" if previous and previous != target else ""
    if previous == target:
        was = " (unchanged)"
    out.print(f"{model.name}: {args.alias} -> {target}{was}", highlight=False, markup=False)
    return 0


# --- export for devices ---------------------------------------------------------------------


def pull_verified(
    mesh: RunningMesh, model: str, version: str
) -> tuple[registry_pb2.ModelVersion, bytes]:
    """A version's record and its artifact, downloaded by the sha256-checked client the model
    servers use (within the spec's artifact size limit)."""
    from servemesh.registry.client import fetch_verified

    async def pull() -> tuple[registry_pb2.ModelVersion, bytes]:
        async with registry_channel(mesh) as channel:
            try:
                return await fetch_verified(
                    channel,
                    model,
                    version,
                    timeout=UPLOAD_TIMEOUT_S,
                    max_bytes=mesh.spec.limits.max_artifact_bytes,
                )
            except grpc.aio.AioRpcError as exc:
                raise _rpc_error(f"the registry at {mesh.spec.registry_address}", exc) from None

    return asyncio.run(pull())


def cmd_export(args: argparse.Namespace) -> int:
    """Pull the version (sha256-verified, as a model server does), export it for a device
    runtime, check it answers as the original, then write it and its manifest."""
    # torch (and onnx) load here, for an export only (servemesh/edge/export.py).
    from servemesh.edge.export import default_out, export_version, write_export

    mesh = running_mesh(args)
    target = Path(args.out) if args.out else default_out(args.model, args.version, args.format)

    record, data = pull_verified(mesh, args.model, args.version)
    exported = export_version(
        data, record, args.format, atol=args.atol, rtol=args.rtol, target=str(target)
    )
    manifest = write_export(exported, target)
    out.print(
        f"exported {record.model} {record.version} ({record.format}, sha256 {record.sha256}) "
        f"to {target}: {exported.format}, {_size(len(exported.data))}, sha256 {exported.sha256}",
        highlight=False,
        markup=False,
    )
    runtime = ", ".join(f"{key} {value}" for key, value in exported.runtime.items())
    diffs = ", ".join(f"{c.name} {c.max_abs_diff:.3g}" for c in exported.checks)
    out.print(
        f"checked on {exported.rows} reference rows ({runtime}): max |diff| {diffs} "
        f"(allowed: atol {exported.atol:g} + rtol {exported.rtol:g} x |original|)",
        highlight=False,
        markup=False,
    )
    if exported.note:
        out.print(f"program: {exported.note}", highlight=False, markup=False)
    out.print(f"manifest: {manifest}", highlight=False, markup=False)
    return 0


def read_reference(path: Path, signature: Signature) -> dict[str, Any]:
    """Reference rows from a file: `.npz` (an array per input name) or `.npy` (the one
    input's rows). Never unpickled: object arrays are refused."""
    import numpy as np

    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ModelsError(_one_line(f"--reference {path}: cannot read: {exc}")) from None
    if isinstance(loaded, np.ndarray):
        if not signature.single:
            names = [t.name for t in signature.inputs]
            raise ModelsError(f"--reference {path}: the model takes {names}; give an .npz")
        return {signature.input.name: loaded}
    with loaded:
        return {name: loaded[name] for name in loaded.files}


def cmd_quantize(args: argparse.Namespace) -> int:
    """Pull the version (sha256-verified), derive it (`servemesh.quantize`), check it on
    reference rows, then push it as a version of its own with lineage and metrics."""
    from servemesh.edge.export import signature_of
    from servemesh.quantize import QuantizeError, quantize_version

    mesh = running_mesh(args)
    name = args.as_version or f"{args.version}-{args.to}"
    try:
        check_name(name, "--as")
    except InvalidArgumentError as exc:
        raise ModelsError(exc.message) from None

    record, data = pull_verified(mesh, args.model, args.version)
    signature = signature_of(record)
    rows = read_reference(Path(args.reference), signature) if args.reference else None
    try:
        derived = quantize_version(
            data,
            record,
            args.to,
            rows=rows,
            max_abs_error=args.max_abs_error,
            min_agreement=args.min_agreement,
        )
    except QuantizeError as exc:
        raise ModelsError(_one_line(str(exc))) from None

    async def upload() -> registry_pb2.ModelVersion:
        async with registry_channel(mesh) as channel:
            try:
                return await push_version(
                    channel,
                    model=record.model,
                    version=name,
                    data=derived.data,
                    inputs=[_spec(t) for t in signature.inputs],
                    outputs=[_spec(t) for t in signature.outputs],
                    credential=credential(mesh),
                    labels={"derived": derived.method},
                    lineage=derived.lineage(),
                    metrics=derived.accuracy.metrics(),
                    format=derived.format,
                    timeout=UPLOAD_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                raise _rpc_error(
                    f"the registry at {mesh.spec.registry_address} refused", exc
                ) from None

    pushed = asyncio.run(upload())
    accuracy = derived.accuracy
    out.print(
        f"pushed {pushed.model} {pushed.version}: {derived.method} of {record.version} "
        f"({derived.layers} layers), {pushed.format}, {_size(pushed.size_bytes)} (source "
        f"{_size(record.size_bytes)}), sha256 {pushed.sha256}",
        highlight=False,
        markup=False,
    )
    out.print(
        f"checked on {accuracy.rows} reference rows: max |error| {accuracy.max_abs_error:.4g} "
        f"(limit {args.max_abs_error:g}), labels agree {accuracy.label_agreement:.1%} "
        f"(limit {args.min_agreement:.1%})",
        highlight=False,
        markup=False,
    )
    return 0


# --- the parser ----------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    models = sub.add_parser(
        "models", help="push, list, show, alias, export and quantize model versions"
    )
    add_mesh_flags(models)
    verbs = models.add_subparsers(dest="verb", required=True)

    push_ = verbs.add_parser(
        "push",
        help="check and probe a TorchScript (.pt) or torch.export (.pt2) file, then upload it",
    )
    add_mesh_flags(push_, inherited=True)
    push_.add_argument("file")
    push_.add_argument("--model", required=True)
    push_.add_argument("--version", required=True)
    push_.add_argument("--signature", help="inputs and outputs (YAML); required for TorchScript")
    push_.add_argument("--label", action="append", metavar="KEY=VALUE", help="repeatable")
    push_.add_argument(
        "--lineage",
        action="append",
        metavar="KEY=VALUE",
        help="e.g. data=sha256:<hex>, code=<git sha> (repeatable)",
    )
    push_.add_argument("--metric", action="append", metavar="NAME=NUMBER", help="repeatable")
    push_.set_defaults(func=cmd_push, error_label="models push")

    list_ = verbs.add_parser(
        "list", help="models, versions, aliases, sizes, replicas holding each, live weight"
    )
    add_mesh_flags(list_, inherited=True)
    add_output(list_)
    list_.set_defaults(func=cmd_list, error_label="models list")

    show = verbs.add_parser(
        "show",
        help="one version: signature, sha256, lineage, metrics, quarantine, crashes...; "
        "without a version, each version's weight, quarantine and crashes",
    )
    add_mesh_flags(show, inherited=True)
    show.add_argument("model")
    show.add_argument("version", nargs="?", help="a version or an alias")
    add_output(show)
    show.set_defaults(func=cmd_show, error_label="models show")

    alias = verbs.add_parser("alias", help="point an alias at a version, e.g. production v2")
    add_mesh_flags(alias, inherited=True)
    alias.add_argument("model")
    alias.add_argument("alias")
    alias.add_argument("version")
    add_gate_overrides(alias)
    alias.set_defaults(func=cmd_alias, error_label="models alias")

    export = verbs.add_parser(
        "export",
        help="write a version for a device runtime (ONNX checked in onnxruntime, or .pt2) "
        "with a manifest; refused when it does not answer as the original",
    )
    add_mesh_flags(export, inherited=True)
    export.add_argument("model")
    export.add_argument("version", help="a version or an alias")
    export.add_argument("--format", required=True, choices=("onnx", "pt2"))
    export.add_argument("--out", help="the file to write (default: ./MODEL-VERSION.onnx|.pt2)")
    export.add_argument(
        "--atol", type=float, default=1e-4, help="allowed absolute difference (default 1e-4)"
    )
    export.add_argument(
        "--rtol", type=float, default=1e-3, help="allowed relative difference (default 1e-3)"
    )
    export.set_defaults(func=cmd_export, error_label="models export")

    quantize = verbs.add_parser(
        "quantize",
        help="push a derived version: dynamic INT8 (CPU) or FP16/BF16 weights (GPU), checked "
        "on reference rows; refused with the numbers when it answers too far off",
    )
    add_mesh_flags(quantize, inherited=True)
    quantize.add_argument("model")
    quantize.add_argument("version", help="the source: a version or an alias")
    quantize.add_argument("--to", required=True, choices=("int8", "fp16", "bf16"))
    quantize.add_argument("--as", dest="as_version", help="the new version (default VERSION-TO)")
    quantize.add_argument(
        "--reference",
        help="reference rows: .npz (an array per input) or .npy (one input); default: drawn "
        "from the signature (zeros, ones, 64 seeded normal rows)",
    )
    quantize.add_argument(
        "--max-abs-error",
        type=float,
        default=0.05,
        help="refuse beyond this absolute error on any output (default 0.05)",
    )
    quantize.add_argument(
        "--min-agreement",
        type=float,
        default=0.99,
        help="refuse when fewer rows agree on the label (argmax, or > 0.5; default 0.99)",
    )
    quantize.set_defaults(func=cmd_quantize, error_label="models quantize")
    quarantine.register(verbs)

    from servemesh.cli import model_control  # imports this module: registered last

    model_control.register(verbs)
