"""Does a model's spec entry fit an artifact's signature? One pure check, three callers.

`servemesh apply` runs it before adding a version, the model server's loader before it
serves one, and the gateway on the signature it learns from a replica: a spec that fills an
input from a view of 3 features and a model that takes 4 is refused with the reason, not
discovered as a failed prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from servemesh.contract.wire import OIP_DATATYPES
from servemesh.spec import ModelSpec

# The datatypes the gateway carries in its public Tensor (docs/models.md).
GATEWAY_DATATYPES = OIP_DATATYPES - {"BYTES"}
# A view's features are floats: an input filled from a view takes one of these.
FLOAT_DATATYPES = frozenset({"FP16", "BF16", "FP32", "FP64"})


class TensorSpecLike(Protocol):
    """A tensor of a signature as the registry's records and OIP metadata both hold one."""

    @property
    def name(self) -> str: ...

    @property
    def datatype(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...


def check_model_contract(
    model_name: str,
    model_spec: ModelSpec,
    inputs: Sequence[TensorSpecLike],
    outputs: Sequence[TensorSpecLike],
) -> list[str]:
    """Every mismatch between `model_spec` and a signature (`inputs`, `outputs`), each naming
    the spec field or tensor concerned; an empty list when they fit."""
    where = f"models.{model_name}"
    problems: list[str] = []
    by_name = {tensor.name: tensor for tensor in inputs}
    filled = model_spec.effective_inputs
    for tensor in inputs:
        if tensor.name not in filled:
            problems.append(
                f"{where}.inputs: the model's input {tensor.name!r} is not mapped; "
                f"the spec fills {sorted(filled)}"
            )
    for name, spec in filled.items():
        field = _input_field(where, model_spec, name)
        found = by_name.get(name)
        if found is None:
            problems.append(
                f"{field}: the model has no input tensor {name!r}; it takes {sorted(by_name)}"
            )
            continue
        shape = [int(d) for d in found.shape]
        if found.datatype not in GATEWAY_DATATYPES:
            problems.append(
                f"{field}: input {name!r} is {found.datatype}, which the gateway does not "
                f"carry; one of {sorted(GATEWAY_DATATYPES)}"
            )
        if not shape or shape[0] != -1:
            problems.append(f"{field}: input {name!r} has shape {shape}; dim 0 must be -1 (rows)")
        if spec.features is None:
            continue  # raw: any per-row shape, the caller sends it
        if found.datatype not in FLOAT_DATATYPES:
            problems.append(
                f"{field}: input {name!r} is {found.datatype} but is filled from feature view "
                f"{spec.view!r}, whose values are floats; one of {sorted(FLOAT_DATATYPES)}"
            )
        if shape[1:] != [len(spec.features)]:
            problems.append(
                f"{field}.features: input {name!r} has shape {shape} but the spec lists "
                f"{len(spec.features)} features (shape [-1, {len(spec.features)}])"
            )
    if not outputs:
        problems.append(f"{where}: the model gives no output")
    for tensor in outputs:
        if tensor.datatype not in GATEWAY_DATATYPES:
            problems.append(
                f"{where}: output {tensor.name!r} is {tensor.datatype}, which the gateway does "
                f"not carry; one of {sorted(GATEWAY_DATATYPES)}"
            )
    return problems


def _input_field(where: str, model_spec: ModelSpec, name: str) -> str:
    # The shorthand's one input is described by its own fields.
    return where if model_spec.inputs is None else f"{where}.inputs.{name}"
