"""Between OIP datatypes, numpy rows and torch tensors.

numpy has no bfloat16: BF16 rows are held as their uint16 bit patterns (what OIP's raw
contents carry) and viewed, not converted, as torch.bfloat16 on the way in and back out.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["OIP_DATATYPES", "TORCH_DTYPES", "oip_datatype", "to_array", "to_tensor"]

# OIP datatype -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
OIP_DATATYPES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def oip_datatype(dtype: torch.dtype) -> str | None:
    """The OIP datatype of a torch dtype, None when OIP has none (complex, float8, ...)."""
    return OIP_DATATYPES.get(dtype)


def to_tensor(rows: np.ndarray, datatype: str | None = None) -> torch.Tensor:
    """A CPU tensor sharing `rows`' memory when it can (a copy of read-only rows)."""
    if not rows.flags.writeable:
        # torch.from_numpy refuses to share read-only memory (np.frombuffer views).
        rows = np.array(rows)
    tensor = torch.from_numpy(rows)
    if datatype == "BF16":
        tensor = tensor.view(torch.bfloat16)
    return tensor


def to_array(tensor: torch.Tensor) -> np.ndarray:
    """A host numpy array of `tensor` (bfloat16 as its uint16 bit patterns)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)
    return tensor.numpy()
