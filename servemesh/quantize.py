"""A registry version made smaller and cheaper: dynamic INT8, or FP16/BF16 weights.

`quantize_version` takes a version's artifact bytes (already sha256-verified by the
registry client) and its record, and answers a derived TorchScript artifact that a model
server loads like any other (through `torchscript_guard` and `op_allowlist`):

| `--to` | what changes | what it is for |
| --- | --- | --- |
| `int8` | every linear layer with constant weights becomes torch's dynamically quantized linear (`torch.ao.nn.quantized.dynamic.Linear`: weights INT8 per output channel, activations quantized per call) | CPU serving: about a quarter of the weight bytes, and faster matrix products |
| `fp16`, `bf16` | every floating weight is stored in that type; inputs are cast to it on the way in and outputs back to their declared type on the way out | GPU serving (on a CPU these types are slower, not faster) |

Inputs and outputs keep the source's signature, so a derived version can take traffic
beside its source. The derivation goes through the version's torch.export program (the
stored one, or torch's TorchScript converter for a TorchScript version, as `models export
--format pt2` does), rewrites its graph, and scripts it.

The derived model is then loaded exactly as a model server would and run on reference rows
(given, or drawn from the signature as `models export` draws them: zeros, ones, seeded
normal rows) beside the source. What is measured becomes the version's metrics:

- `quantize_max_abs_error`: the largest absolute difference on any floating output;
- `quantize_label_agreement`: the share of rows whose label agrees: the argmax of an output
  with several columns, the value thresholded at 0.5 for an output with one column;
- `quantize_reference_rows`.

A derivation beyond the limits (`max_abs_error`, `min_agreement`) is refused
(`QuantizeRefused`) with the numbers, and nothing is pushed.

None of it runs in the caller's process: the source is loaded, rewritten, scripted and run
in a sandboxed child (`python -m servemesh.quantize`: `servemesh.sandbox.child` with a
`derive` op), the derived bytes come back as bytes, and the derived model is run in a
sandboxed child of its own (docs/security.md, "Offline runs"). This process compares arrays.
"""  # noqa: E501

from __future__ import annotations

import hashlib
import io
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from servemesh.contract.errors import ServemeshError

if TYPE_CHECKING:
    import torch

    from servemesh.sandbox.child import Loaded
    from servemesh.sandbox.frames import Frame
    from servemesh.sandbox.model import SandboxedModel
    from servemesh.services.model.tensors import Signature

Method = Literal["int8", "fp16", "bf16"]
METHODS: dict[str, str] = {"int8": "dynamic-int8", "fp16": "fp16", "bf16": "bf16"}
DEFAULT_MAX_ABS_ERROR = 0.05
DEFAULT_MIN_AGREEMENT = 0.99
# How a label is read from an output with one column.
LABEL_THRESHOLD = 0.5
# Loading, converting and scripting a big model in its sandbox: seconds, sometimes minutes.
SANDBOX_TIMEOUT_S = 600.0
_FLOAT_DATATYPES = frozenset({"FP16", "BF16", "FP32", "FP64"})
# The sandboxed child that derives: this module's `main`.
ENTRY: tuple[str, ...] = ("-m", "servemesh.quantize")
DERIVE_OP = "derive"


class QuantizeError(ServemeshError):
    """The version cannot be derived that way (the message says why, in one line)."""


class QuantizeRefused(QuantizeError):
    """The derived version does not answer closely enough: nothing was pushed."""

    label = "refused"


@dataclass(frozen=True)
class Accuracy:
    rows: int
    max_abs_error: float
    label_agreement: float

    def metrics(self) -> dict[str, float]:
        return {
            "quantize_max_abs_error": self.max_abs_error,
            "quantize_label_agreement": self.label_agreement,
            "quantize_reference_rows": float(self.rows),
        }


@dataclass(frozen=True)
class Derived:
    """A derived artifact (TorchScript), checked; `layers`: the layers it changed."""

    data: bytes
    sha256: str
    method: str
    layers: int
    accuracy: Accuracy
    source_version: str
    source_sha256: str

    @property
    def format(self) -> str:
        return "torchscript"

    def lineage(self) -> dict[str, str]:
        return {
            "source_version": self.source_version,
            "source_sha256": self.source_sha256,
            "method": self.method,
        }


@dataclass(frozen=True)
class VersionRecord:
    """The fields of a registry version that quantize reads (a registry ModelVersion has
    them too), for an artifact that is not in a registry: a derived one being checked, a
    bench model."""

    model: str
    version: str
    sha256: str
    format: str
    inputs: Sequence[Any]
    outputs: Sequence[Any]


def quantize_version(
    data: bytes,
    record: Any,
    to: Method,
    *,
    rows: Mapping[str, np.ndarray] | None = None,
    max_abs_error: float = DEFAULT_MAX_ABS_ERROR,
    min_agreement: float = DEFAULT_MIN_AGREEMENT,
) -> Derived:
    """Derive `to` from the version `record` (a registry ModelVersion) whose verified bytes
    are `data`; checked on `rows` (by input name; default: drawn from the signature).

    Raises QuantizeError when the version cannot be derived, QuantizeRefused when the
    derived model answers beyond `max_abs_error` or below `min_agreement`.
    """
    from servemesh.edge.export import ExportError, reference_rows, signature_of

    if to not in METHODS:
        raise QuantizeError(f"--to {to!r} is not one of {sorted(METHODS)}")
    if not (math.isfinite(max_abs_error) and max_abs_error >= 0):
        raise QuantizeError("--max-abs-error must be finite and not negative")
    if not 0 <= min_agreement <= 1:
        raise QuantizeError("--min-agreement must be between 0 and 1")
    from servemesh.sandbox.model import ModelCrashed, ModelFailed

    where = f"{record.model} {record.version}"
    if record.format == "onnx":
        raise QuantizeError(
            f"{where} is an ONNX model: quantize derives from torch models; quantize it with "
            "onnxruntime.quantization before pushing, and push the result as a version"
        )
    try:
        signature = signature_of(record)
    except ExportError as exc:
        raise QuantizeError(str(exc)) from None
    reference = _reference(signature, rows if rows is not None else reference_rows(signature))
    count = int(next(iter(reference.values())).shape[0])
    with _open(data, record, signature, count, ENTRY, "") as source:
        # The rewrite first: a model it cannot cover is refused before any rows are run.
        try:
            answer = source.ask(DERIVE_OP, {"to": to})
        except ModelFailed as exc:
            if exc.kind == "refused":
                raise QuantizeError(str(exc)) from None
            raise QuantizeError(f"{where}: the derivation failed ({exc.error}: {exc})") from None
        except ModelCrashed as exc:
            raise QuantizeError(f"{where}: the derivation: {exc}") from None
        derived, layers = answer.blob, answer.header.get("layers")
        if not isinstance(layers, int) or isinstance(layers, bool) or not derived:
            raise QuantizeError(f"{where}: the sandboxed derivation answered a malformed frame")
        try:
            expected = _answers(source, signature, reference)
        except (ModelFailed, ModelCrashed) as exc:
            # Drawn rows can be outside what the model takes (an index past its table).
            raise QuantizeError(
                f"{where}: the source model fails on the reference rows ({_why(exc)}); "
                "give rows it takes with --reference"
            ) from None
    got = _answers_of_derived(derived, record, signature, reference, count, to)
    accuracy = measure_accuracy(signature, expected, got)
    if accuracy.max_abs_error > max_abs_error or accuracy.label_agreement < min_agreement:
        raise QuantizeRefused(
            f"{where} as {to}: max |error| {accuracy.max_abs_error:.4g} (limit "
            f"{max_abs_error:g}), labels agree on {accuracy.label_agreement:.1%} of "
            f"{accuracy.rows} reference rows (limit {min_agreement:.1%}); nothing was pushed"
        )
    return Derived(
        data=derived,
        sha256=hashlib.sha256(derived).hexdigest(),
        method=METHODS[to],
        layers=layers,
        accuracy=accuracy,
        source_version=record.version,
        source_sha256=record.sha256,
    )


def _reference(signature: Signature, rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    missing = [t.name for t in signature.inputs if t.name not in rows]
    if missing:
        raise QuantizeError(f"reference rows: no values for input(s) {missing}")
    found = {}
    for tensor in signature.inputs:
        array = np.ascontiguousarray(rows[tensor.name], dtype=tensor.dtype)
        if array.ndim != len(tensor.shape) or tuple(array.shape[1:]) != tuple(tensor.dims):
            raise QuantizeError(
                f"reference rows: input {tensor.name!r} has shape {list(array.shape)}, the "
                f"signature takes {list(tensor.shape)}"
            )
        found[tensor.name] = array
    counts = {array.shape[0] for array in found.values()}
    if len(counts) != 1 or 0 in counts:
        raise QuantizeError("reference rows: every input needs the same number of rows, > 0")
    return found


# --- the graph rewrite ---------------------------------------------------------------------


def _derive(program: Any, signature: Signature, to: Method, where: str) -> tuple[Any, int]:
    """The program as a scriptable fx.GraphModule, rewritten for `to`; and how many layers
    (int8) or weights (fp16/bf16) changed."""
    import torch

    # A plain GraphModule of the unlifted one: torch.export's subclass carries methods of
    # its own (input checks) that TorchScript cannot compile.
    unlifted = program.module()
    module = torch.fx.GraphModule(unlifted, unlifted.graph)
    graph = module.graph
    for node in list(graph.nodes):
        # torch.export's input guards: the derived model has its own signature check.
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    if to == "int8":
        changed = _quantize_linear(module)
        if not changed:
            raise QuantizeError(
                f"{where}: no linear layer with constant weights to quantize (dynamic INT8 "
                "covers linear layers)"
            )
    else:
        changed = _cast(module, signature, torch.float16 if to == "fp16" else torch.bfloat16)
    _plain_calls(module)
    module.delete_all_unused_submodules()
    module.recompile()
    return module, changed


def _quantize_linear(module: Any) -> int:
    """Replace each `aten.linear(x, weight, bias)` whose weight is a constant 2-D float
    tensor of the module with torch's dynamically quantized linear (per-channel weights)."""
    import torch
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    graph = module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        x, weight_node, *rest = node.args
        bias_node = rest[0] if rest else None
        weight = _constant(module, weight_node)
        bias = _constant(module, bias_node) if bias_node is not None else None
        if weight is None or weight.dim() != 2 or not weight.is_floating_point():
            continue
        if bias_node is not None and bias is None:
            continue
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight.float())
            if bias is not None:
                linear.bias.copy_(bias.float())
        linear.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]
        name = f"quantized_linear_{count}"
        with warnings.catch_warnings():
            # torch 2.13 marks its quantized tensor types deprecated (docs/models.md says
            # what that means for INT8 versions); the kernels are the supported ones today.
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions")
            quantized = DynamicLinear.from_float(linear)
        module.add_submodule(name, quantized)
        with graph.inserting_before(node):
            replacement = graph.call_module(name, (x,))
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        count += 1
    _drop_unused_constants(module)
    return count


def _cast(module: Any, signature: Signature, dtype: torch.dtype) -> int:
    """Store every floating constant in `dtype`; cast floating inputs to it and floating
    outputs back to their declared types."""
    graph = module.graph
    count = 0
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        value = _constant(module, node)
        if value is not None and value.is_floating_point() and value.dtype != dtype:
            _set_constant(module, node.target, value.to(dtype))
            count += 1
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for tensor, node in zip(signature.inputs, placeholders, strict=False):
        if tensor.datatype not in _FLOAT_DATATYPES:
            continue
        with graph.inserting_after(node):
            cast = graph.call_method("to", (node, dtype))
        node.replace_all_uses_with(cast, delete_user_cb=_not(cast))
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    flat = list(results) if isinstance(results, (tuple, list)) else [results]
    cast_back = []
    for tensor, value in zip(signature.outputs, flat, strict=False):
        if tensor.datatype in _FLOAT_DATATYPES:
            with graph.inserting_before(output):
                value = graph.call_method("to", (value, _torch_dtype(tensor.dtype)))
        cast_back.append(value)
    output.args = (
        type(results)(cast_back) if isinstance(results, (tuple, list)) else cast_back[0],
    )
    return count


def _not(node: Any) -> Any:
    return lambda user: user is not node


def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    import torch

    return torch.from_numpy(np.zeros(1, dtype=dtype)).dtype


def _constant(module: Any, node: Any) -> torch.Tensor | None:
    import torch

    if getattr(node, "op", None) != "get_attr":
        return None
    owner, _, name = str(node.target).rpartition(".")
    holder = module.get_submodule(owner) if owner else module
    value = getattr(holder, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _set_constant(module: Any, target: str, value: torch.Tensor) -> None:
    import torch

    owner, _, name = target.rpartition(".")
    holder = module.get_submodule(owner) if owner else module
    if isinstance(getattr(holder, name), torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=False)
    if name in holder._parameters:
        holder._parameters[name] = value
    elif name in holder._buffers:
        holder._buffers[name] = value
    else:
        setattr(holder, name, value)


def _drop_unused_constants(module: Any) -> None:
    """Remove the float weights the quantized layers replaced (they would be saved too)."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    used = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
    for name, _ in list(module.named_parameters(remove_duplicate=False)):
        if name not in used and "." not in name:
            delattr(module, name)
    for name, _ in list(module.named_buffers(remove_duplicate=False)):
        if name not in used and "." not in name:
            delattr(module, name)


def _plain_calls(module: Any) -> None:
    """Make the exported graph's code scriptable: operators by their packet
    (`torch.ops.aten.relu`, which TorchScript resolves, not `.default`), positional
    inputs and plain outputs instead of torch.export's pytree flattening."""
    import torch

    graph = module.graph
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = node.target.overloadpacket
    graph._codegen = torch.fx.graph.CodeGen()
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    if isinstance(results, (tuple, list)) and len(results) == 1:
        output.args = (results[0],)
    elif isinstance(results, list):
        output.args = (tuple(results),)
    graph.eliminate_dead_code()


def _script(module: Any, where: str) -> bytes:
    """TorchScript bytes of the rewritten module, the same bytes for the same weights."""
    import torch

    from servemesh.contract.demo import canonical_torchscript

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scripted = torch.jit.script(module)
    except Exception as exc:
        raise QuantizeError(
            f"{where}: the derived model does not script: {_first_line(exc)}"
        ) from None
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    return canonical_torchscript(buffer.getvalue())


def _answers_of_derived(
    data: bytes,
    record: Any,
    signature: Signature,
    rows: Mapping[str, np.ndarray],
    count: int,
    to: str,
) -> list[Any]:
    """The derived model's answers, loaded as a model server loads it (guard and runner), in
    a sandboxed child of its own."""
    from servemesh.registry.records import TensorSpec
    from servemesh.sandbox.model import ModelCrashed, ModelFailed, SandboxedModelError

    derived_record = VersionRecord(
        model=record.model,
        version=f"{record.version}-{to}",
        sha256=hashlib.sha256(data).hexdigest(),
        format="torchscript",
        inputs=[TensorSpec(t.name, t.datatype, t.shape) for t in signature.inputs],
        outputs=[TensorSpec(t.name, t.datatype, t.shape) for t in signature.outputs],
    )
    try:
        with _open(data, derived_record, signature, count, None, "the derived model does not "
                   "load: ") as derived:  # fmt: skip
            return _answers(derived, signature, rows)
    except (ModelFailed, ModelCrashed) as exc:
        raise QuantizeError(
            f"{record.model} {record.version} as {to}: the derived model fails on the "
            f"reference rows: {_why(exc)}"
        ) from None
    except SandboxedModelError as exc:  # pragma: no cover - every kind is named above
        raise QuantizeError(f"the derived model: {exc}") from None


def _open(
    data: bytes,
    record: Any,
    signature: Signature,
    rows: int,
    entry: Sequence[str] | None,
    refused: str,
) -> SandboxedModel:
    """`data` in a sandboxed child (its sha256 checked here first); `entry`: this module's
    child (None: the plain one). QuantizeError, prefixed with `refused`, when it does not
    load."""
    from servemesh.sandbox.model import CHILD_ENTRY, SandboxedModel, SandboxedModelError
    from servemesh.services.model.runner import ArtifactMismatch, verify_artifact

    where = f"{record.model} {record.version}"
    try:
        verify_artifact(data, record.sha256)
        return SandboxedModel.open(
            data,
            declared=signature,
            model=record.model,
            version=record.version,
            max_batch_size=max(rows, 1),
            num_threads=None,
            timeout_s=SANDBOX_TIMEOUT_S,
            entry=CHILD_ENTRY if entry is None else entry,
        )
    except (ArtifactMismatch, SandboxedModelError) as exc:
        raise QuantizeError(f"{refused}{where}: {exc}") from None


def _answers(
    model: SandboxedModel, signature: Signature, rows: Mapping[str, np.ndarray]
) -> list[np.ndarray]:
    answer = model.run({t.name: rows[t.name] for t in signature.inputs})
    return [answer[t.name] for t in signature.outputs]


def _why(exc: BaseException) -> str:
    error = getattr(exc, "error", "")
    return f"{error}: {exc}" if error else str(exc)


# --- the sandboxed child -------------------------------------------------------------------


def _derive_op(loaded: Loaded, frame: Frame) -> Frame:
    """The `derive` op, in the child: the program (stored or converted), rewritten and
    scripted; the derived TorchScript bytes, and how many layers changed."""
    from servemesh.edge.export import ExportError, program_of
    from servemesh.sandbox.frames import Frame

    to = frame.header.get("to")
    if to not in METHODS:
        raise QuantizeError(f"--to {to!r} is not one of {sorted(METHODS)}")
    where = f"{loaded.model} {loaded.version}"
    try:
        program, _ = program_of(loaded.data, loaded, loaded.signature)
    except ExportError as exc:
        raise QuantizeError(str(exc)) from None
    if program.call_spec.out_spec is not None and program.call_spec.out_spec.type is dict:
        raise QuantizeError(f"{where}: the model returns a dict; quantize serves tensor outputs")
    module, layers = _derive(program, loaded.signature, to, where)
    return Frame({"layers": layers}, blob=_script(module, where))


def _prepare() -> None:
    """What the derivation imports, loaded before the child's walls go up."""
    import torch._export.converter  # noqa: F401
    import torch.ao.nn.quantized.dynamic  # noqa: F401
    import torch.ao.quantization  # noqa: F401

    import servemesh.contract.demo  # noqa: F401
    import servemesh.edge.export  # noqa: F401


def main() -> int:
    """`python -I -B -m servemesh.quantize`: the sandboxed child that derives."""
    from servemesh.sandbox.child import serve

    return serve({DERIVE_OP: _derive_op}, _prepare)


def _first_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# --- accuracy --------------------------------------------------------------------------------


def measure_accuracy(signature: Signature, expected: Sequence[Any], got: Sequence[Any]) -> Accuracy:
    """The largest absolute error over the floating outputs, and the share of rows whose
    label agrees on every output (argmax of several columns; > 0.5 of one column; integer
    outputs exactly)."""
    rows = 0
    largest = 0.0
    agree: np.ndarray | None = None
    for tensor, want, have in zip(signature.outputs, expected, got, strict=True):
        want = np.asarray(want, dtype=np.float64)
        have = np.asarray(have, dtype=np.float64)
        if want.shape != have.shape:
            raise QuantizeError(
                f"output {tensor.name!r}: the derived model answers shape "
                f"{list(have.shape)}, the source {list(want.shape)}"
            )
        rows = want.shape[0]
        flat_want = want.reshape(rows, -1)
        flat_have = have.reshape(rows, -1)
        if tensor.datatype in _FLOAT_DATATYPES:
            diff = np.abs(flat_have - flat_want)
            worst = float(diff.max()) if diff.size else 0.0
            largest = max(largest, math.inf if math.isnan(worst) else worst)
            if flat_want.shape[1] == 1:
                same = (flat_want[:, 0] > LABEL_THRESHOLD) == (flat_have[:, 0] > LABEL_THRESHOLD)
            else:
                same = flat_want.argmax(axis=1) == flat_have.argmax(axis=1)
        else:
            same = np.all(flat_want == flat_have, axis=1)
        agree = same if agree is None else agree & same
    share = float(agree.mean()) if agree is not None and agree.size else 1.0
    return Accuracy(rows=rows, max_abs_error=round(largest, 6), label_agreement=round(share, 4))


if __name__ == "__main__":
    sys.exit(main())
