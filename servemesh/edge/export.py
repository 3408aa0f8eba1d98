"""A registry version exported for a device runtime, checked before it is written.

`export_version` takes a version's artifact bytes (already sha256-verified by the registry
client, and checked again here by the model server's own runner) and its record, and
answers the bytes of one of:

| format | what a device loads | how it is checked |
| --- | --- | --- |
| `onnx` | an ONNX model (`torch.onnx.export`, the dynamo exporter) for onnxruntime or any ONNX runtime | onnxruntime answers the reference rows within `atol` + `rtol` x abs(original) of the model server's answer, on every output (integer outputs exactly) |
| `pt2` | a torch.export program (`torch.export.load`, ExecuTorch's input) | the program passes the model server's operator allowlist and answers as the original; a `torch_export` version is written as stored (the same bytes); a TorchScript version is converted (torch's TorchScript converter), or refused, saying so |

The original is the artifact as a model server runs it: loaded through the allowlist
(`services/model/artifacts.py`) by `ModelRunner`. Every step that runs the model's code
(its answer, torch's tracing and export, the export's own answer) runs in a sandboxed child
(`servemesh.edge.child`, docs/security.md "Offline runs"); this process sends rows and
gets arrays and the exported bytes back, and compares them. The reference rows are deterministic from
the signature (`reference_rows`: zeros, ones, then seeded normal values) or given (e.g. a
data set's held-out rows). An export that does not answer within the tolerance is refused:
`ExportRefused` names the output and its largest difference, and nothing is written.

`write_export` writes the file and its manifest (`<file>.manifest.json`: inputs and outputs
with datatypes and shapes, the file's sha256, the source model, version, format and sha256,
the check's tolerance, rows and measured differences) atomically, the file first.
"""  # noqa: E501

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from servemesh.contract.atomic import atomic_write_bytes
from servemesh.contract.errors import ServemeshError

if TYPE_CHECKING:
    from servemesh.sandbox.model import SandboxedModel
    from servemesh.services.model.tensors import Signature

__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "EXPORT_FORMATS",
    "ExportError",
    "ExportRefused",
    "Exported",
    "OutputCheck",
    "answers_of",
    "export_version",
    "manifest_path",
    "open_sandboxed",
    "program_of",
    "reference_rows",
    "run_onnx",
    "sandboxed_answers",
    "signature_of",
    "write_export",
]

ExportFormat = Literal["onnx", "pt2"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("onnx", "pt2")
SUFFIXES: dict[str, str] = {"onnx": ".onnx", "pt2": ".pt2"}
DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-3
# Rows drawn from the signature when none are given: zeros, ones, then this many more.
REFERENCE_ROWS = 64
REFERENCE_SEED = 0
MANIFEST_SUFFIX = ".manifest.json"
# Loading, tracing and exporting a big model in its sandbox: seconds, sometimes minutes.
SANDBOX_TIMEOUT_S = 600.0
# A file the device reads: readable by the device runtime's user as well as its owner's.
EXPORT_MODE = 0o644
_FLOAT_DATATYPES = frozenset({"FP16", "BF16", "FP32", "FP64"})


class ExportError(ServemeshError):
    """The version cannot be exported in that format (the message says why, in one line)."""


class ExportRefused(ExportError):
    """The export was made but does not answer as the original: nothing was written."""


@dataclass(frozen=True)
class OutputCheck:
    """One output compared on the reference rows: the largest absolute difference, and
    whether every element is within atol + rtol x abs(original) (exactly, for integers)."""

    name: str
    datatype: str
    max_abs_diff: float
    passed: bool


@dataclass(frozen=True)
class Exported:
    """An export that passed its check, ready to write."""

    format: ExportFormat
    data: bytes
    sha256: str
    model: str
    version: str
    source_sha256: str
    source_format: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    checks: list[OutputCheck]
    rows: int
    atol: float
    rtol: float
    runtime: dict[str, str]
    note: str = ""

    @property
    def max_abs_diff(self) -> float:
        return max((check.max_abs_diff for check in self.checks), default=0.0)

    def manifest(self, file_name: str) -> dict[str, Any]:
        return {
            "format": self.format,
            "file": file_name,
            "sha256": self.sha256,
            "size_bytes": len(self.data),
            "source": {
                "model": self.model,
                "version": self.version,
                "sha256": self.source_sha256,
                "format": self.source_format,
            },
            "inputs": self.inputs,
            "outputs": self.outputs,
            "check": {
                "runtime": self.runtime,
                "rows": self.rows,
                "atol": self.atol,
                "rtol": self.rtol,
                "max_abs_diff": {check.name: check.max_abs_diff for check in self.checks},
                "passed": True,
            },
            **({"note": self.note} if self.note else {}),
        }


def manifest_path(path: Path) -> Path:
    """Where the manifest of an exported file lives: beside it, `<file>.manifest.json`."""
    return path.with_name(path.name + MANIFEST_SUFFIX)


def reference_rows(
    signature: Signature, rows: int = REFERENCE_ROWS, seed: int = REFERENCE_SEED
) -> dict[str, np.ndarray]:
    """Deterministic rows for every input: zeros, ones (the push's probe rows), then `rows`
    seeded standard-normal rows (small non-negative integers for integer inputs)."""
    rng = np.random.default_rng(seed)
    found: dict[str, np.ndarray] = {}
    for tensor in signature.inputs:
        shape = (rows, *tensor.dims)
        if tensor.datatype == "BOOL":
            drawn = rng.integers(0, 2, size=shape).astype(bool)
        elif tensor.datatype in _FLOAT_DATATYPES:
            drawn = rng.standard_normal(shape)
        else:
            drawn = rng.integers(0, 8, size=shape)
        probe = np.stack([np.zeros(tensor.dims), np.ones(tensor.dims)])
        found[tensor.name] = np.concatenate([probe, drawn]).astype(tensor.dtype)
    return found


def signature_of(record: Any) -> Signature:
    from servemesh.services.model.tensors import Signature

    try:
        return Signature.from_specs(
            record.inputs, record.outputs, where=f"{record.model} {record.version} signature"
        )
    except ValueError as exc:
        raise ExportError(str(exc)) from None


def _tensor_json(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": [int(d) for d in spec.shape]}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporters print progress and warn about their own internals: kept off the
    command's output (a failure still raises)."""
    sink = io.StringIO()
    exporter_logs = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript", "torch")]
    levels = [logger.level for logger in exporter_logs]
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(sink),
        contextlib.redirect_stderr(sink),
    ):
        warnings.simplefilter("ignore")
        for logger in exporter_logs:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(exporter_logs, levels, strict=True):
                logger.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    return (text[0] if text else type(exc).__name__)[:300]


def open_sandboxed(
    data: bytes,
    record: Any,
    signature: Signature,
    rows: int,
    entry: Sequence[str] | None = None,
) -> SandboxedModel:
    """The model as a model server runs it, in a sandboxed child: sha256 checked again here,
    loaded through the operator allowlist there, outputs checked against the signature.
    `entry`: the child's module (default: this package's, which can also export)."""
    from servemesh.edge.child import ENTRY
    from servemesh.sandbox.model import ModelRefused, SandboxedModel, SandboxedModelError
    from servemesh.services.model.runner import ArtifactMismatch, verify_artifact

    where = f"{record.model} {record.version}"
    try:
        verify_artifact(data, record.sha256)
    except ArtifactMismatch as exc:
        raise ExportError(f"{where}: {exc}") from None
    try:
        return SandboxedModel.open(
            data,
            declared=signature,
            model=record.model,
            version=record.version,
            max_batch_size=max(rows, 1),
            num_threads=None,
            timeout_s=SANDBOX_TIMEOUT_S,
            entry=ENTRY if entry is None else entry,
        )
    except ModelRefused as exc:
        raise ExportError(f"{where}: {exc}") from None
    except SandboxedModelError as exc:
        raise ExportError(f"{where}: the model did not load in its sandbox: {exc}") from None


def answers_of(runner: Any, signature: Signature, rows: Mapping[str, np.ndarray]) -> list[Any]:
    """The runner's answer to `rows`, one array per output in the signature's order (in the
    sandboxed child: `sandboxed_answers` is the caller's side)."""
    from servemesh.services.model.batching.rows import NamedRows

    if signature.single:
        return [runner.run(rows[signature.input.name])]
    answer = runner.run(NamedRows(dict(rows)))
    return [answer[tensor.name] for tensor in signature.outputs]


def sandboxed_answers(
    model: SandboxedModel, signature: Signature, rows: Mapping[str, np.ndarray]
) -> list[np.ndarray]:
    """A sandboxed model's answer to `rows`, one array per output in the signature's order."""
    answer = model.run({t.name: rows[t.name] for t in signature.inputs})
    return [answer[tensor.name] for tensor in signature.outputs]


def program_of(data: bytes, record: Any, signature: Signature) -> tuple[Any, str]:
    """The version as a torch.export program, and a note on where it came from."""
    import torch

    from servemesh.services.model.pt2_guard import (
        UnsafeArtifact,
        check_export_archive,
        check_loaded_program,
    )

    where = f"{record.model} {record.version}"
    if record.format == "torch_export":
        try:
            check_export_archive(data)
            program = torch.export.load(io.BytesIO(data))
            check_loaded_program(program)
        except UnsafeArtifact as exc:
            raise ExportError(f"{where}: torch.export archive refused: {exc}") from None
        return program, "the registry's torch.export program, as stored"
    # TorchScript: torch's TorchScript -> torch.export converter, traced on the probe rows.
    from torch._export.converter import TS2EPConverter

    from servemesh.services.model.artifacts import ArtifactError, load_module

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated")
            module = load_module(data, "torchscript", "cpu")
    except ArtifactError as exc:
        raise ExportError(f"{where}: {exc}") from None

    example = tuple(torch.from_numpy(array) for array in reference_rows(signature, rows=0).values())
    try:
        with _quiet():
            program = TS2EPConverter(module, example).convert()  # type: ignore[arg-type]
    except Exception as exc:
        raise ExportError(
            f"{where}: this TorchScript model cannot be converted to a torch.export program "
            f"({type(exc).__name__}: {_first_line(exc)}); export the model from its Python "
            "source with torch.export.export and push that (.pt2) instead"
        ) from None
    return program, "converted from TorchScript by torch's TorchScript converter"


def _onnx_bytes(program: Any, signature: Signature, where: str) -> tuple[bytes, str]:
    import torch

    try:
        import onnx  # noqa: F401  (the exporter needs it: fail with the extra's name)
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ExportError(
            f"ONNX export needs the edge extra: pip install 'servemesh[edge]' ({exc.name} "
            "is missing)"
        ) from None
    example = tuple(torch.from_numpy(array) for array in reference_rows(signature, rows=0).values())
    try:
        with _quiet():
            onnx_program = torch.onnx.export(
                program,
                example,
                dynamo=True,
                input_names=[t.name for t in signature.inputs],
                output_names=[t.name for t in signature.outputs],
                optimize=True,
                verbose=False,
            )
            assert onnx_program is not None
            proto = onnx_program.model_proto
    except Exception as exc:
        raise ExportError(
            f"{where}: torch.onnx.export failed ({type(exc).__name__}: {_first_line(exc)})"
        ) from None
    opset = next((str(o.version) for o in proto.opset_import if o.domain in ("", "ai.onnx")), "?")
    return proto.SerializeToString(), opset


def run_onnx(data: bytes, rows: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """An ONNX model's answer to `rows` in onnxruntime (CPU), one array per output."""
    import onnxruntime  # type: ignore[import-untyped]

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(
        data, sess_options=options, providers=["CPUExecutionProvider"]
    )
    names = [item.name for item in session.get_inputs()]
    return [np.asarray(a) for a in session.run(None, {name: rows[name] for name in names})]


def _compare(
    signature: Signature,
    expected: Sequence[Any],
    got: Sequence[Any],
    atol: float,
    rtol: float,
    where: str,
) -> list[OutputCheck]:
    if len(got) != len(expected):
        raise ExportRefused(
            f"{where}: the export answers {len(got)} outputs, the original {len(expected)}"
        )
    checks = []
    for tensor, want, have in zip(signature.outputs, expected, got, strict=True):
        want, have = np.asarray(want), np.asarray(have)
        if want.shape != have.shape:
            raise ExportRefused(
                f"{where}: output {tensor.name!r} has shape {list(have.shape)}, the "
                f"original's {list(want.shape)}"
            )
        wide_want, wide_have = want.astype(np.float64), have.astype(np.float64)
        diff = np.abs(wide_have - wide_want)
        largest = float(diff.max()) if diff.size else 0.0
        if tensor.datatype in _FLOAT_DATATYPES:
            bound = atol + rtol * np.abs(wide_want)
            passed = bool(np.all(diff <= bound)) and not np.isnan(diff).any()
        else:
            passed = bool(np.array_equal(want, have))
        if math.isnan(largest):
            largest = math.inf
        checks.append(OutputCheck(tensor.name, tensor.datatype, largest, passed))
    return checks


def export_version(
    data: bytes,
    record: Any,
    format: ExportFormat,
    *,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    rows: Mapping[str, np.ndarray] | None = None,
    target: str = "",
) -> Exported:
    """Export the version `record` (a registry ModelVersion) whose verified bytes are `data`.

    `rows`: the reference rows by input name (default `reference_rows`). `target` names
    the file to be in a refusal. Raises ExportError when the version cannot be exported,
    ExportRefused when the export does not answer within the tolerance. The model, torch's
    export of it and the export's check run in a sandboxed child (`servemesh.edge.child`).
    """
    if format not in EXPORT_FORMATS:
        raise ExportError(f"format {format!r} is not one of {list(EXPORT_FORMATS)}")
    if not (atol >= 0 and rtol >= 0 and math.isfinite(atol) and math.isfinite(rtol)):
        raise ExportError("--atol and --rtol must be finite and not negative")
    where = f"{record.model} {record.version}"
    if record.format == "onnx":
        # Served as ONNX already: its bytes are the device's file (`edge sync --format
        # artifact`), and torch cannot read an ONNX graph back into a program.
        raise ExportError(
            f"{where} is an ONNX model already: `edge sync --format artifact` writes its "
            "bytes as they are"
        )
    signature = signature_of(record)
    reference = dict(rows) if rows is not None else reference_rows(signature)
    missing = [t.name for t in signature.inputs if t.name not in reference]
    if missing:
        raise ExportError(f"reference rows: no values for input(s) {missing}")
    reference = {
        t.name: np.ascontiguousarray(reference[t.name], dtype=t.dtype) for t in signature.inputs
    }
    count = int(next(iter(reference.values())).shape[0])
    exported, expected, got, runtime, note = _export_sandboxed(
        data, record, signature, reference, format
    )
    checks = _compare(signature, expected, got, atol, rtol, target or where)
    failed = [check for check in checks if not check.passed]
    if failed:
        worst = max(failed, key=lambda check: check.max_abs_diff)
        raise ExportRefused(
            f"{target or where}: not written: output {worst.name!r} differs from the original "
            f"by up to {worst.max_abs_diff:.3g} on {count} reference rows "
            f"(allowed: atol {atol:g} + rtol {rtol:g} x |original|"
            f"{', exactly for integers' if worst.datatype not in _FLOAT_DATATYPES else ''})"
        )
    return Exported(
        format=format,
        data=exported,
        sha256=hashlib.sha256(exported).hexdigest(),
        model=record.model,
        version=record.version,
        source_sha256=record.sha256,
        source_format=record.format,
        inputs=[_tensor_json(t) for t in record.inputs],
        outputs=[_tensor_json(t) for t in record.outputs],
        checks=checks,
        rows=count,
        atol=atol,
        rtol=rtol,
        runtime=runtime,
        note=note,
    )


def _export_sandboxed(
    data: bytes,
    record: Any,
    signature: Signature,
    reference: Mapping[str, np.ndarray],
    format: ExportFormat,
) -> tuple[bytes, list[Any], list[Any], dict[str, str], str]:
    """In one sandboxed child: the original's answer to `reference`, the export, and the
    export's answer; (exported bytes, expected, got, runtime, note)."""
    from servemesh.edge.child import EXPORT_OP
    from servemesh.sandbox.model import ModelCrashed, ModelFailed

    where = f"{record.model} {record.version}"
    count = int(next(iter(reference.values())).shape[0])
    with open_sandboxed(data, record, signature, count) as original:
        try:
            expected = sandboxed_answers(original, signature, reference)
        except ModelFailed as exc:
            raise ExportError(
                f"{where}: the model fails on the reference rows ({exc.error or exc.kind}: {exc})"
            ) from None
        except ModelCrashed as exc:
            raise ExportError(f"{where}: {exc}") from None
        try:
            answer = original.ask(EXPORT_OP, {"format": format}, reference)
        except ModelFailed as exc:
            if exc.kind != "refused":
                raise ExportError(
                    f"{where}: the export failed ({exc.error or exc.kind}: {exc})"
                ) from None
            kind = ExportRefused if exc.error == "ExportRefused" else ExportError
            raise kind(str(exc)) from None
        except ModelCrashed as exc:
            raise ExportError(f"{where}: the export: {exc}") from None
    got = [answer.arrays[key] for key in sorted(answer.arrays, key=int)]
    runtime = answer.header.get("runtime")
    note = answer.header.get("note")
    if not (
        isinstance(runtime, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in runtime.items())
        and isinstance(note, str)
        and all(key.isdigit() for key in answer.arrays)
    ):
        raise ExportError(f"{where}: the sandboxed export answered a malformed header")
    # A torch.export version's .pt2 is its stored bytes, which this process already holds.
    exported = data if format == "pt2" and record.format == "torch_export" else answer.blob
    return exported, expected, got, dict(runtime), note[:300]


def _pt2_answers(
    exported: bytes,
    record: Any,
    signature: Signature,
    reference: Mapping[str, np.ndarray],
    count: int,
) -> list[Any]:
    """The exported program's answer, loaded as a model server loads a .pt2 (allowlist):
    in the sandboxed child (`servemesh.edge.child`), never in the caller's process."""
    from servemesh.services.model.artifacts import ArtifactError, open_artifact, reconcile_signature
    from servemesh.services.model.runner import ModelRunner

    try:
        opened = open_artifact(exported, "cpu")
        reconcile_signature(opened.signature, signature)
    except ArtifactError as exc:
        raise ExportRefused(
            f"{record.model} {record.version}: the converted program is refused: {exc}"
        ) from None
    runner = ModelRunner(
        opened.module,
        model=record.model,
        version=record.version,
        signature=signature,
        device="cpu",
        max_batch_size=max(count, 1),
        num_threads=None,
    )
    return answers_of(runner, signature, reference)


def default_out(model: str, version: str, format: ExportFormat) -> Path:
    """`<model>-<version>.onnx` (or `.pt2`) in the current folder."""
    return Path(f"{model}-{version}{SUFFIXES[format]}")


def write_export(exported: Exported, path: Path) -> Path:
    """Write the file, then its manifest, each atomically; answers the manifest's path."""
    atomic_write_bytes(path, exported.data, mode=EXPORT_MODE)
    manifest = manifest_path(path)
    text = json.dumps(exported.manifest(path.name), indent=2) + "\n"
    atomic_write_bytes(manifest, text.encode(), mode=EXPORT_MODE)
    _fsync_dir(path.parent)
    return manifest


def _fsync_dir(folder: Path) -> None:
    """Make the renames durable: the folder's entries flushed too."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
