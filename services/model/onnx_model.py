"""ONNX models: the checks a graph must pass before onnxruntime sees it, the signature it
records, and the session that runs it behind the same runner as a torch model.

An ONNX file is a protobuf message, so reading it runs nothing of its author's; what it
may ask of the runtime is the question. The checks (`check_model`) refuse:

- operators outside ONNX's standard domains (`ai.onnx`, `ai.onnx.ml`) that are not
  functions defined in the file itself: a custom-op domain names code of a shared library
  the runtime would have to load;
- tensors whose bytes live in an external file: the artifact the registry hashed is one
  file, and a path in it would point the runtime at some other file on the host;
- an IR version or opset outside what the installed onnx knows (onnxruntime refuses newer
  ones at load as well, with a less helpful message);
- inputs and outputs that are not tensors of an OIP datatype with a dynamic batch dim first
  and fixed dims after it (a scikit-learn classifier converted with its ZipMap output, a
  list of dicts, is the common case: convert with `options={"zipmap": False}`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from servemesh.contract.errors import ServemeshError
from servemesh.services.model.tensors import Signature, TensorSig

if TYPE_CHECKING:
    import onnx

__all__ = [
    "MIN_OPSETS",
    "OnnxModule",
    "OnnxRefused",
    "check_model",
    "is_onnx",
    "onnx_signature",
    "open_onnx",
    "parse_model",
]

# The standard domains, and the oldest opset of each that onnxruntime still runs. The
# newest is the installed onnx's (`_max_opset`).
MIN_OPSETS: dict[str, int] = {"": 7, "ai.onnx": 7, "ai.onnx.ml": 1}
_MIN_IR_VERSION = 3
# TensorProto.DataType -> OIP datatype. STRING is left out on purpose: the mesh's tensors
# carry numbers, and categories reach a model encoded as numbers. BFLOAT16 too: numpy, which
# onnxruntime's feeds and answers are, has no such type.
_DATATYPES: dict[int, str] = {
    1: "FP32",
    2: "UINT8",
    3: "INT8",
    4: "UINT16",
    5: "INT16",
    6: "INT32",
    7: "INT64",
    9: "BOOL",
    10: "FP16",
    11: "FP64",
    12: "UINT32",
    13: "UINT64",
}
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


class OnnxRefused(ServemeshError, ValueError):
    """The ONNX file is not one the model servers run; the message says why, in one line."""


def is_onnx(data: bytes) -> bool:
    """Whether `data` parses as an ONNX model with a graph and an opset: what tells an ONNX
    file from any other bytes, since protobuf has no magic number."""
    try:
        model = parse_model(data)
    except OnnxRefused:
        return False
    return model.ir_version > 0 and model.HasField("graph") and len(model.opset_import) > 0


def parse_model(data: bytes) -> onnx.ModelProto:
    """The ModelProto of `data` (OnnxRefused when the bytes are not one)."""
    import onnx
    from google.protobuf.message import DecodeError

    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        raise OnnxRefused("not an ONNX model: the bytes do not parse as one") from None
    return model


def _max_opset(domain: str) -> int:
    import onnx.defs

    if domain == "ai.onnx.ml":
        return int(onnx.defs.onnx_ml_opset_version())
    return int(onnx.defs.onnx_opset_version())


def check_model(model: onnx.ModelProto) -> None:
    """Raise OnnxRefused naming the first thing the model servers would not run."""
    import onnx

    if not _MIN_IR_VERSION <= model.ir_version <= onnx.IR_VERSION:
        raise OnnxRefused(
            f"IR version {model.ir_version} is outside {_MIN_IR_VERSION}..{onnx.IR_VERSION} "
            "(the installed onnx's range)"
        )
    if not model.opset_import:
        raise OnnxRefused("the model imports no opset")
    local = {(function.domain, function.name) for function in model.functions}
    local_domains = {domain for domain, _ in local}
    for opset in model.opset_import:
        if opset.domain in local_domains and opset.domain not in MIN_OPSETS:
            continue  # functions the file defines, themselves checked node by node below
        if opset.domain not in MIN_OPSETS:
            raise OnnxRefused(
                f"opset domain {opset.domain!r} is not a standard one (custom operators are "
                f"not run); allowed: {sorted({d or 'ai.onnx' for d in MIN_OPSETS})}"
            )
        low, high = MIN_OPSETS[opset.domain], _max_opset(opset.domain)
        if not low <= opset.version <= high:
            raise OnnxRefused(
                f"opset {opset.domain or 'ai.onnx'} {opset.version} is outside the "
                f"supported {low}..{high}"
            )
    for where, graph_nodes in _node_lists(model):
        for node in graph_nodes:
            if node.domain not in MIN_OPSETS and (node.domain, node.op_type) not in local:
                raise OnnxRefused(
                    f"{where}: node {node.name or node.op_type!r} is {node.domain}::"
                    f"{node.op_type}, a custom operator (only ONNX's standard domains run)"
                )
    for where, tensor in _tensors(model):
        if tensor.data_location == _EXTERNAL or len(tensor.external_data):
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            raise OnnxRefused(
                f"{where}: tensor {tensor.name!r} keeps its data in an external file "
                f"({location!r}); save the model as one file "
                "(onnx.save_model(model, path, save_as_external_data=False))"
            )


def _subgraphs(nodes: Sequence[onnx.NodeProto], where: str) -> Iterator[tuple[str, Any]]:
    for node in nodes:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield f"{where}/{node.name or node.op_type}.{attribute.name}", attribute.g
            for index, graph in enumerate(attribute.graphs):
                yield f"{where}/{node.name or node.op_type}.{attribute.name}[{index}]", graph


def _graphs(model: onnx.ModelProto) -> Iterator[tuple[str, Any]]:
    """Every graph of the model with where it is: the main one and each subgraph (If,
    Loop, Scan bodies), however deep."""
    pending: list[tuple[str, Any]] = [("graph", model.graph)]
    for function in model.functions:
        pending.extend(_subgraphs(function.node, f"function {function.domain}::{function.name}"))
    while pending:
        where, graph = pending.pop()
        yield where, graph
        pending.extend(_subgraphs(graph.node, where))


def _node_lists(model: onnx.ModelProto) -> Iterator[tuple[str, Sequence[onnx.NodeProto]]]:
    for where, graph in _graphs(model):
        yield where, graph.node
    for function in model.functions:
        yield f"function {function.domain}::{function.name}", function.node


def _tensors(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """Every tensor that can hold data: initializers (dense and sparse) and constant
    attributes, in every graph and function."""
    for where, graph in _graphs(model):
        for tensor in graph.initializer:
            yield where, tensor
        for sparse in graph.sparse_initializer:
            yield where, sparse.values
            yield where, sparse.indices
    for where, nodes in _node_lists(model):
        for node in nodes:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield where, attribute.t
                yield from ((where, tensor) for tensor in attribute.tensors)


def onnx_signature(model: onnx.ModelProto) -> Signature:
    """The signature the graph records: its inputs (less the initializers some exporters
    list among them) and outputs, each a tensor of an OIP datatype, batch dim first."""
    graph = model.graph
    constants = {tensor.name for tensor in graph.initializer}
    inputs = [_tensor_sig(value, "input") for value in graph.input if value.name not in constants]
    outputs = [_tensor_sig(value, "output") for value in graph.output]
    if not inputs:
        raise OnnxRefused("the graph takes no input")
    try:
        return Signature(inputs=inputs, outputs=outputs)
    except ValueError as exc:
        raise OnnxRefused(str(exc)) from None


def _tensor_sig(value: onnx.ValueInfoProto, kind: str) -> TensorSig:
    what = f"{kind} {value.name!r}"
    held = value.type.WhichOneof("value")
    if held != "tensor_type":
        hint = (
            "; a classifier's ZipMap output: convert with options={'zipmap': False}"
            if held in ("sequence_type", "map_type")
            else ""
        )
        raise OnnxRefused(f"{what} is a {held or 'value of no type'}, not a tensor{hint}")
    tensor = value.type.tensor_type
    datatype = _DATATYPES.get(tensor.elem_type)
    if datatype is None:
        import onnx

        name = onnx.TensorProto.DataType.Name(tensor.elem_type) if tensor.elem_type else "?"
        raise OnnxRefused(f"{what} is {name}, which the mesh's tensors do not carry")
    if not tensor.HasField("shape") or not tensor.shape.dim:
        raise OnnxRefused(f"{what} has no shape; every tensor needs a batch dim first")
    first, *rest = tensor.shape.dim
    if first.HasField("dim_value"):
        raise OnnxRefused(
            f"{what} has a fixed first dim {first.dim_value}: convert it with a dynamic batch "
            "dim (None in the converter's input types)"
        )
    dims: list[int] = []
    for index, dim in enumerate(rest, start=1):
        if not dim.HasField("dim_value") or dim.dim_value < 1:
            raise OnnxRefused(f"{what} dim {index} is dynamic; only the batch dim may vary")
        dims.append(int(dim.dim_value))
    return TensorSig(value.name, datatype, (-1, *dims))


class OnnxModule:
    """An onnxruntime session called as a torch module is: positional tensors in the
    signature's input order, a tuple of tensors in its output order.

    The runner (`runner.ModelRunner`) keeps batching, signature checks and warm-up as it
    does for torch; this holds only the session. Tensors cross as numpy arrays that share
    memory with them (no copy on the CPU).
    """

    def __init__(
        self,
        data: bytes,
        model: onnx.ModelProto,
        *,
        device: torch.device,
        num_threads: int | None = 1,
    ) -> None:
        import onnxruntime  # type: ignore[import-untyped]

        options = onnxruntime.SessionOptions()
        # One model per replica and the replica's batcher runs one batch at a time: the
        # intra-op threads are the runner's num_threads, as torch's are.
        if num_threads is not None:
            options.intra_op_num_threads = int(num_threads)
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3  # errors only: its warnings are not the caller's
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in (
            onnxruntime.get_available_providers()
        ):
            providers.insert(0, "CUDAExecutionProvider")
        self.providers = providers
        self._session = onnxruntime.InferenceSession(data, options, providers=providers)
        constants = {tensor.name for tensor in model.graph.initializer}
        self._inputs = [v.name for v in model.graph.input if v.name not in constants]
        self._outputs = [v.name for v in model.graph.output]
        # What a memory budget is charged: the file's size. A tree ensemble keeps its
        # parameters in node attributes, not initializers, and the session holds them all.
        self.weight_bytes = len(data)

    def run_arrays(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The session on host arrays, in the signature's input order; its outputs in the
        signature's output order. What the runner calls: no tensor in between, since a
        torch round trip costs a small tree model more than the trees do."""
        feeds = dict(zip(self._inputs, arrays, strict=True))
        return list(self._session.run(self._outputs, feeds))

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        answers = self.run_arrays([tensor.detach().cpu().numpy() for tensor in tensors])
        return tuple(torch.from_numpy(np.ascontiguousarray(answer)) for answer in answers)


def open_onnx(
    data: bytes, device: torch.device, num_threads: int | None = 1
) -> tuple[OnnxModule, Signature]:
    """Check, then load an ONNX model: the module to run and the signature it records.

    Raises OnnxRefused for what the checks refuse; whatever onnxruntime raises at load
    passes through (the caller names it).
    """
    model = parse_model(data)
    check_model(model)
    signature = onnx_signature(model)
    return OnnxModule(data, model, device=device, num_threads=num_threads), signature
