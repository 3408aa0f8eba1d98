"""Small real models with several named tensors, built the way users build theirs.

`Churn` takes FP32 features and an INT64 category and gives FP32 probabilities [n, 3] and an
INT64 label [n]; `Dtypes` passes FP16, BF16, BOOL and INT32 tensors through simple maths.
Each comes as a TorchScript archive (`scripted`) or a torch.export archive (`exported`).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch

from servemesh.services.model.tensors import Signature, TensorSig

CHURN_FEATURES = 4
CHURN_CATEGORIES = 5

CHURN_SIGNATURE = Signature(
    inputs=[
        TensorSig("features", "FP32", (-1, CHURN_FEATURES)),
        TensorSig("category", "INT64", (-1,)),
    ],
    outputs=[
        TensorSig("probabilities", "FP32", (-1, 3)),
        TensorSig("label", "INT64", (-1,)),
    ],
)

# The same signature as a `--signature` file says it (`servemesh models push`).
CHURN_SIGNATURE_YAML = {
    "inputs": [
        {"name": "features", "datatype": "FP32", "shape": [-1, CHURN_FEATURES]},
        {"name": "category", "datatype": "INT64", "shape": [-1]},
    ],
    "outputs": [
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "label", "datatype": "INT64", "shape": [-1]},
    ],
}

DTYPES_SIGNATURE = Signature(
    inputs=[
        TensorSig("half", "FP16", (-1, 3)),
        TensorSig("brain", "BF16", (-1, 3)),
        TensorSig("flags", "BOOL", (-1,)),
        TensorSig("counts", "INT32", (-1, 2)),
    ],
    outputs=[
        TensorSig("half_doubled", "FP16", (-1, 3)),
        TensorSig("brain_plus_one", "BF16", (-1, 3)),
        TensorSig("flags_flipped", "BOOL", (-1,)),
        TensorSig("counts_tripled", "INT32", (-1, 2)),
    ],
)


class Churn(torch.nn.Module):
    """Features plus an embedded category, softmaxed into three classes.

    Plain parameters, no nn.Linear or nn.Embedding: TorchScript compiles a library module
    into a type per configuration, and a new type in this process would change the bytes
    of the demo artifacts other tests script after it.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(CHURN_FEATURES, 3, generator=generator))
        self.bias = torch.nn.Parameter(torch.randn(3, generator=generator))
        self.table = torch.nn.Parameter(torch.randn(CHURN_CATEGORIES, 3, generator=generator))

    def forward(
        self, features: torch.Tensor, category: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = features @ self.weight + self.bias + self.table[category]
        probabilities = torch.softmax(logits, dim=-1)
        return probabilities, probabilities.argmax(dim=-1)


class Dtypes(torch.nn.Module):
    """One simple operation per datatype, so each answer is known exactly."""

    def forward(
        self, half: torch.Tensor, brain: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return half * 2, brain + 1, torch.logical_not(flags), counts * 3


def churn_reference(
    model: Churn, features: np.ndarray, category: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """What the model itself answers, straight through torch."""
    with torch.inference_mode():
        probabilities, label = model(torch.from_numpy(features), torch.from_numpy(category))
    return probabilities.numpy(), label.numpy()


def scripted(model: torch.nn.Module) -> bytes:
    """The model as a TorchScript archive."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        torch.jit.save(torch.jit.script(model.eval()), buffer)
    return buffer.getvalue()


def exported(model: torch.nn.Module, example: tuple[torch.Tensor, ...]) -> bytes:
    """The model as a torch.export archive, every input's first dim a shared batch dim."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    names = list(model.forward.__code__.co_varnames[1 : 1 + len(example)])
    dynamic = {name: {0: batch} for name in names}
    program = torch.export.export(model.eval(), example, dynamic_shapes=dynamic)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def churn_example(rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, CHURN_FEATURES), torch.zeros(rows, dtype=torch.int64)


def dtypes_example(rows: int = 2) -> tuple[torch.Tensor, ...]:
    return (
        torch.ones(rows, 3, dtype=torch.float16),
        torch.ones(rows, 3, dtype=torch.bfloat16),
        torch.ones(rows, dtype=torch.bool),
        torch.ones(rows, 2, dtype=torch.int32),
    )
