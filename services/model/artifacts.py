"""Model artifacts: which format a file is, loading it without running its author's Python,
and the signature it records.

| format | written by | loaded with | signature |
| --- | --- | --- | --- |
| `torchscript` | `torch.jit.save` (`.pt`) | `torchscript_guard`: the archive checked, compiled by torch, every operator of every function checked against `op_allowlist`, then wrapped as `torch.jit.load` does | none recorded: declared at push |
| `torch_export` | `torch.export.save` (`.pt2`) | `pt2_guard`'s allowlist first (operators from `op_allowlist`), then `torch.export.load` | the program's user inputs and outputs |
| `onnx` | any ONNX converter (`skl2onnx`, `onnxmltools`, `torch.onnx.export`) (`.onnx`) | `onnx_model`'s checks (standard domains only, no external data, opsets in range), then an onnxruntime session | the graph's inputs and outputs |

A plain `torch.save` checkpoint (a pickle, even inside a zip) is neither and is refused: it
would need unpickling, which can run any code.
"""  # noqa: E501

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from servemesh.contract.errors import ServemeshError
from servemesh.services.model.onnx_model import OnnxModule, OnnxRefused, is_onnx, open_onnx
from servemesh.services.model.pt2_guard import (
    UnsafeArtifact,
    check_export_archive,
    check_loaded_program,
    whole_zip,
)
from servemesh.services.model.tensors import Signature, TensorSig
from servemesh.services.model.torch_types import oip_datatype
from servemesh.services.model.torchscript_guard import load_checked

__all__ = [
    "FORMATS",
    "PLATFORMS",
    "ArtifactError",
    "as_format",
    "Format",
    "OpenedArtifact",
    "detect_format",
    "exported_signature",
    "load_module",
    "may_be_onnx",
    "open_artifact",
    "reconcile_signature",
]

Format = Literal["torchscript", "torch_export", "onnx"]
FORMATS: tuple[Format, ...] = ("torchscript", "torch_export", "onnx")
# What OIP ModelMetadata reports as `platform` for each format (ONNX: the name other OIP
# servers give onnxruntime).
PLATFORMS: dict[str, str] = {
    "torchscript": "pytorch_torchscript",
    "torch_export": "pytorch_torch_export",
    "onnx": "onnxruntime_onnx",
}
_ZIP_MAGIC = b"PK\x03\x04"


class ArtifactError(ServemeshError, ValueError):
    """The bytes are not a model servemesh loads; the message says why, in one line."""


@dataclass(frozen=True)
class OpenedArtifact:
    """A loaded model: its format, the callable to run, and the signature it records."""

    format: Format
    module: Callable[..., Any]
    signature: Signature | None  # None: the format records none (TorchScript)


def as_format(name: str) -> Format:
    """A registry record's format name as a Format (ArtifactError when it is none)."""
    for known in FORMATS:
        if known == name:
            return known
    raise ArtifactError(f"format {name!r} is not one of {list(FORMATS)}")


def may_be_onnx(data: bytes) -> bool:
    """Whether `data` may be an ONNX model: anything but a zip archive (a byte test, not a
    parse; `detect_format` parses)."""
    return not data.startswith(_ZIP_MAGIC)


def detect_format(data: bytes) -> Format:
    """Which format `data` is; ArtifactError for anything else (or a damaged archive)."""
    if may_be_onnx(data):
        if is_onnx(data):
            return "onnx"
        raise ArtifactError(
            "not a model: neither a TorchScript (.pt) nor a torch.export (.pt2) archive, "
            "nor an ONNX model (.onnx)"
        )
    try:
        with whole_zip(data) as archive:
            names = archive.namelist()
    except UnsafeArtifact as exc:
        raise ArtifactError(str(exc)) from None
    paths = {name.partition("/")[2] for name in names}
    if "archive_format" in paths:
        return "torch_export"
    if "data.pkl" in paths and any(path.startswith("code/") for path in paths):
        return "torchscript"
    if "data.pkl" in paths:
        raise ArtifactError(
            "a pickled torch.save checkpoint, not a model program: save it with "
            "torch.export.save (or torch.jit.save); servemesh never unpickles models"
        )
    raise ArtifactError("not a model: a zip archive, but not a TorchScript or torch.export one")


def load_module(
    data: bytes, format: Format, device: torch.device | str = "cpu", num_threads: int | None = 1
) -> Callable[..., Any]:
    """The runnable module of an artifact in `format` (ArtifactError when it does not load).
    `num_threads`: an ONNX session's intra-op threads (torch's are set by the runner)."""
    if format == "onnx":
        return _open_onnx(data, torch.device(device), num_threads)[0]
    return _open(data, format, torch.device(device))[0]


def open_artifact(
    data: bytes, device: torch.device | str = "cpu", num_threads: int | None = 1
) -> OpenedArtifact:
    """Detect the format, load (checked first when it is torch.export or ONNX), read the
    signature."""
    format = detect_format(data)
    if format == "onnx":
        session, recorded = _open_onnx(data, torch.device(device), num_threads)
        return OpenedArtifact(format=format, module=session, signature=recorded)
    module, program = _open(data, format, torch.device(device))
    signature = exported_signature(program) if program is not None else None
    return OpenedArtifact(format=format, module=module, signature=signature)


def _open_onnx(
    data: bytes, device: torch.device, num_threads: int | None
) -> tuple[OnnxModule, Signature]:
    try:
        return open_onnx(data, device, num_threads)
    except OnnxRefused as exc:
        raise ArtifactError(f"ONNX model refused: {exc}") from None
    except Exception as exc:
        raise ArtifactError(f"ONNX model does not load: {_first_line(exc)}") from None


def _open(
    data: bytes, format: Format, device: torch.device
) -> tuple[Callable[..., Any], torch.export.ExportedProgram | None]:
    if format == "torchscript":
        try:
            module = load_checked(data, device)
        except UnsafeArtifact as exc:
            raise ArtifactError(f"TorchScript archive refused: {exc}") from None
        except Exception as exc:
            raise ArtifactError(f"TorchScript archive does not load: {_first_line(exc)}") from None
        return module.eval(), None
    if format != "torch_export":
        raise ArtifactError(f"format {format!r} is not one of {list(FORMATS)}")
    try:
        check_export_archive(data)
    except UnsafeArtifact as exc:
        raise ArtifactError(f"torch.export archive refused: {exc}") from None
    try:
        program = torch.export.load(io.BytesIO(data))
    except Exception as exc:
        raise ArtifactError(f"torch.export archive does not load: {_first_line(exc)}") from None
    try:
        check_loaded_program(program)
    except UnsafeArtifact as exc:
        raise ArtifactError(f"torch.export archive refused: {exc}") from None
    return program.module().to(device), program


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def exported_signature(program: torch.export.ExportedProgram) -> Signature:
    """The signature an exported program records: its user inputs (by forward argument
    name) and outputs (by dict key when it returns a dict, else output_0, output_1, ...),
    with their datatypes and shapes; dim 0 must be a batch dim that every tensor shares.

    Raises ArtifactError naming the tensor when the program cannot be served batched.
    """
    in_spec = program.call_spec.in_spec
    if in_spec is not None and in_spec.num_children == 2 and in_spec.child(1).num_children:
        raise ArtifactError("the program takes keyword arguments; export it with positional ones")
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user_inputs = list(program.graph_signature.user_inputs)
    call_graph = program.module_call_graph
    names = (
        call_graph[0].signature.forward_arg_names
        if call_graph and call_graph[0].signature is not None
        else None
    ) or [str(name) for name in user_inputs]
    if len(names) != len(user_inputs):
        raise ArtifactError(
            f"the program takes {len(user_inputs)} tensors through {len(names)} arguments; "
            "export it with one tensor per argument"
        )
    batch: object = None
    inputs: list[TensorSig] = []
    for name, node_name in zip(names, user_inputs, strict=True):
        node = placeholders.get(str(node_name))
        value = node.meta.get("val") if node is not None else None
        sig, batch = _tensor_sig(value, f"input {name!r}", name, batch)
        inputs.append(sig)
    [output_node] = [n for n in program.graph.nodes if n.op == "output"]
    flat = list(output_node.args[0]) if isinstance(output_node.args[0], (tuple, list)) else []
    user_outputs = flat[len(flat) - len(program.graph_signature.user_outputs) :]
    out_spec = program.call_spec.out_spec
    if out_spec is not None and out_spec.type is dict:
        output_names = [str(key) for key in out_spec.context]
    else:
        output_names = [f"output_{index}" for index in range(len(user_outputs))]
    if len(output_names) != len(user_outputs):
        raise ArtifactError("the program's outputs are nested; return tensors, a tuple or a dict")
    outputs = []
    for name, output in zip(output_names, user_outputs, strict=True):
        value = output.meta.get("val") if isinstance(output, torch.fx.Node) else None
        sig, _ = _tensor_sig(value, f"output {name!r}", name, batch)
        outputs.append(sig)
    try:
        return Signature(inputs=inputs, outputs=outputs)
    except ValueError as exc:
        raise ArtifactError(str(exc)) from None


def _tensor_sig(value: Any, what: str, name: str, batch: object) -> tuple[TensorSig, object]:
    """The TensorSig of one exported tensor, and the batch dim's symbol (checked shared)."""
    if not isinstance(value, torch.Tensor):
        raise ArtifactError(f"{what} is not a tensor; only tensors are served")
    datatype = oip_datatype(value.dtype)
    if datatype is None:
        raise ArtifactError(f"{what} is {value.dtype}, which has no OIP datatype")
    if value.dim() == 0:
        raise ArtifactError(f"{what} is a scalar; every tensor needs a batch dim first")
    first, rest = value.shape[0], value.shape[1:]
    if not isinstance(first, torch.SymInt):
        raise ArtifactError(
            f"{what} has a fixed first dim {int(first)}: export it with a dynamic batch dim, "
            f"e.g. dynamic_shapes={{{name!r}: {{0: torch.export.Dim('batch')}}}}"
        )
    symbol = first.node.expr
    if batch is not None and symbol != batch:
        raise ArtifactError(
            f"{what} has batch dim {symbol}, another tensor {batch}: every input and output "
            "must share one batch dim (one torch.export.Dim for all inputs)"
        )
    dims = []
    for index, dim in enumerate(rest, start=1):
        if isinstance(dim, torch.SymInt):
            raise ArtifactError(
                f"{what} dim {index} is dynamic; only the batch dim (dim 0) may vary"
            )
        dims.append(int(dim))
    return TensorSig(name, datatype, (-1, *dims)), symbol


def reconcile_signature(recorded: Signature | None, declared: Signature | None) -> Signature:
    """The signature to serve: the declared one (which may rename tensors), else the one the
    artifact records. Both given, they must agree tensor by tensor on datatype and shape.

    Raises ArtifactError naming the first disagreement, or when there is neither.
    """
    if declared is None:
        if recorded is None:
            raise ArtifactError(
                "a TorchScript archive records no signature: declare one (--signature sig.yaml)"
            )
        return recorded
    if recorded is None:
        return declared
    for kind in ("inputs", "outputs"):
        mine: tuple[TensorSig, ...] = getattr(declared, kind)
        theirs: tuple[TensorSig, ...] = getattr(recorded, kind)
        if len(mine) != len(theirs):
            raise ArtifactError(
                f"the declared signature has {len(mine)} {kind}, the program {len(theirs)}"
            )
        for index, (ours, program) in enumerate(zip(mine, theirs, strict=True)):
            if (ours.datatype, ours.shape) != (program.datatype, program.shape):
                raise ArtifactError(
                    f"declared {kind}[{index}] {ours.name!r} is {ours.datatype} "
                    f"{list(ours.shape)}, the program's {program.name!r} is "
                    f"{program.datatype} {list(program.shape)}"
                )
    return declared
