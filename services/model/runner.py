"""One loaded model for one (model, version), and the forward pass on a batch.

The module is called with the signature's inputs as positional tensors, in order, and may
answer one tensor, a tuple or list of them (in the signature's output order), or a dict
keyed by output name. Every output is checked against the signature (count, datatype, dims
after the batch dim) after every forward pass: a model that does not keep its declared
signature fails warm-up, and so never serves.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from servemesh.contract.errors import ServemeshError
from servemesh.services.model.artifacts import Format, load_module
from servemesh.services.model.batching.rows import NamedRows, Rows, join_rows, row_count
from servemesh.services.model.on_demand import weight_bytes
from servemesh.services.model.tensors import Signature
from servemesh.services.model.torch_types import TORCH_DTYPES, oip_datatype, to_array, to_tensor

log = logging.getLogger(__name__)

# The demo box has 2 cores shared by Envoy, the gateway, the feature service, Redis and the
# model servers. Intra-op threads buy little for a small MLP at batch <= 64 and, when every
# replica spreads over all cores, they oversubscribe the CPU and turn into tail latency.
# Throughput comes from batching and replicas instead; raise it on a bigger machine.
DEFAULT_NUM_THREADS = 1

_WARM_UP_RUNS = 3  # the TorchScript profiling executor specialises on the first calls


@dataclass(frozen=True)
class _Port:
    """One tensor the runner passes in or checks coming out."""

    name: str
    dims: tuple[int, ...] | None  # after the batch dim; None: not checked
    dtype: np.dtype[Any] | None  # how numpy holds it; None: not checked
    datatype: str | None  # the OIP datatype; None: unknown (the one-tensor legacy form)


class SignatureViolation(ServemeshError, ValueError):
    """The model's answer does not keep its signature (count, datatype, dims or rows)."""


class NonFiniteOutput(ServemeshError, ValueError):
    """The model answered NaN or an infinity on rows where it must answer numbers."""


class ArtifactMismatch(ServemeshError):
    """The artifact bytes do not hash to the sha256 the registry recorded for them."""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def verify_artifact(data: bytes, sha256: str, size_bytes: int | None = None) -> None:
    """Raise ArtifactMismatch unless `data` has the given sha256 (and size, when given)."""
    if size_bytes is not None and len(data) != size_bytes:
        raise ArtifactMismatch(f"artifact is {len(data)} bytes, registry says {size_bytes}")
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256.lower():
        raise ArtifactMismatch(f"artifact sha256 {actual} does not match the registry's {sha256}")


class ModelRunner:
    """A loaded model (TorchScript or an exported program) ready to run batches.

    Built from a `signature` (what the model server does), or, for a one-input one-output
    model, from `row_shape`/`dtype`/`output_row_shape` alone (then outputs are checked for
    their dims only, and only when `output_row_shape` is given). `run` takes and answers
    one array for a single-tensor model and NamedRows otherwise (`batching.rows`).

    `run` is called from the batcher's single worker thread, never from the event loop. On
    CUDA a single input is staged in pinned host memory so the host-to-device copy can be
    asynchronous; the result copy back synchronises the stream, so the staging buffer is
    free again when `run` returns.
    """

    def __init__(
        self,
        module: Callable[..., Any],
        *,
        model: str,
        version: str,
        signature: Signature | None = None,
        row_shape: Sequence[int] | None = None,
        dtype: np.dtype[Any] | type = np.float32,
        output_row_shape: Sequence[int] | None = None,
        max_batch_size: int = 64,
        device: torch.device | str | None = None,
        inject_latency_ms: float = 0.0,
        num_threads: int | None = DEFAULT_NUM_THREADS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.model = model
        self.version = version
        self.signature = signature
        if signature is not None:
            if row_shape is not None or output_row_shape is not None:
                raise ValueError("give a signature or row_shape/output_row_shape, not both")
            self._inputs = [_Port(t.name, t.dims, t.dtype, t.datatype) for t in signature.inputs]
            self._outputs = [_Port(t.name, t.dims, t.dtype, t.datatype) for t in signature.outputs]
            self._single = signature.single
        elif row_shape is not None:
            self._inputs = [_Port("input", tuple(row_shape), np.dtype(dtype), None)]
            wanted = tuple(output_row_shape) if output_row_shape is not None else None
            self._outputs = [_Port("output", wanted, None, None)]
            self._single = True
        else:
            raise ValueError("a signature or a row_shape is required")
        first = self._inputs[0]
        self.row_shape = first.dims or ()
        self.dtype = first.dtype if first.dtype is not None else np.dtype(np.float32)
        self.output_row_shape = self._outputs[0].dims
        self.max_batch_size = max_batch_size
        self.device = torch.device(device) if device is not None else default_device()
        self.inject_latency_s = inject_latency_ms / 1000.0
        self._sleep = sleep  # how the injected latency is spent (tests pass a recorder)
        self.num_threads = num_threads
        if isinstance(module, torch.nn.Module):
            module = module.to(self.device)
            # An exported program's module is already inference-only and refuses eval().
            if not isinstance(module, torch.fx.GraphModule):
                module = module.eval()
        self._module = module
        # A module that runs on host arrays (an onnxruntime session) is called without torch.
        self._run_arrays: Callable[[Sequence[np.ndarray]], list[np.ndarray]] | None = getattr(
            module, "run_arrays", None
        )
        self._pinned: torch.Tensor | None = None
        if self.device.type == "cuda" and self._single:
            staged = to_tensor(np.zeros((0, *self.row_shape), self.dtype), first.datatype)
            self._pinned = torch.empty(
                (max_batch_size, *self.row_shape), dtype=staged.dtype, pin_memory=True
            )
        self._threads_set: set[int] = set()

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        sha256: str,
        model: str,
        version: str,
        format: Format = "torchscript",
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> ModelRunner:
        """Verify the artifact's sha256 (again: defence in depth), then load it (`artifacts`).

        Raises ArtifactMismatch before torch ever parses bytes that are not the registry's,
        ArtifactError when they are not a model servemesh loads.
        """
        verify_artifact(data, sha256)
        target = torch.device(device) if device is not None else default_device()
        threads = kwargs.get("num_threads", DEFAULT_NUM_THREADS)
        module = load_module(data, format, target, num_threads=threads)
        return cls(module, model=model, version=version, device=target, **kwargs)

    def weight_bytes(self) -> int:
        """Bytes of the model's weights (`on_demand.weight_bytes`): what it costs a budget."""
        return weight_bytes(self._module)

    @property
    def single(self) -> bool:
        """One input and one output: rows are one array, not NamedRows."""
        return self._single

    def run(self, batch: Rows) -> Rows:
        """The model's output for `batch` (rows first), as numpy arrays on the host.

        Sleeps `inject_latency_ms` first when set: a drill knob that makes every batch slow.
        """
        if self.inject_latency_s:
            self._sleep(self.inject_latency_s)
        return self._forward(batch)

    def _forward(self, batch: Rows) -> Rows:
        self._pin_threads()
        if isinstance(batch, NamedRows):
            missing = [port.name for port in self._inputs if port.name not in batch]
            if missing or self._single:
                raise TypeError(f"rows do not fit the model's inputs (missing {missing})")
            arrays = [batch[port.name] for port in self._inputs]
        elif self._single:
            arrays = [batch]
        else:
            raise TypeError("a multi-tensor model takes NamedRows")
        if self._run_arrays is not None:
            results = self._run_arrays(arrays)
            if len(results) != len(self._outputs):
                raise SignatureViolation(
                    f"model returned {len(results)} outputs, the signature declares "
                    f"{len(self._outputs)}"
                )
            for port, result in zip(self._outputs, results, strict=True):
                self._check_array_datatype(port, result)
        else:
            results = self._torch_forward(arrays)
        for port, result in zip(self._outputs, results, strict=True):
            self._check_dims(port, result)
        if self._single:
            return results[0]
        names = [port.name for port in self._outputs]
        return NamedRows(dict(zip(names, results, strict=True)))

    def _torch_forward(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        with torch.inference_mode():
            if self._single:
                tensors = [self._to_device(to_tensor(arrays[0], self._inputs[0].datatype))]
            else:
                tensors = [
                    to_tensor(rows, port.datatype).to(self.device)
                    for rows, port in zip(arrays, self._inputs, strict=True)
                ]
            outputs = self._outputs_of(self._module(*tensors))
            for port, tensor in zip(self._outputs, outputs, strict=True):
                self._check_datatype(port, tensor)
            return [to_array(tensor) for tensor in outputs]

    def _outputs_of(self, output: Any) -> list[torch.Tensor]:
        """The model's answer as tensors in the signature's output order."""
        names = [port.name for port in self._outputs]
        if isinstance(output, torch.Tensor):
            found: list[Any] = [output]
        elif isinstance(output, (tuple, list)):
            found = list(output)
        elif isinstance(output, dict):
            unknown = sorted(set(output) - set(names))
            absent = [name for name in names if name not in output]
            if unknown or absent:
                raise SignatureViolation(
                    f"model returned outputs {sorted(output)}, the signature declares {names}"
                )
            found = [output[name] for name in names]
        else:
            raise SignatureViolation(f"model returned {type(output).__name__}, expected tensors")
        if len(found) != len(names):
            raise SignatureViolation(
                f"model returned {len(found)} outputs, the signature declares {len(names)}"
            )
        for name, value in zip(names, found, strict=True):
            if not isinstance(value, torch.Tensor):
                raise SignatureViolation(
                    f"model output {name!r} is {type(value).__name__}, not a tensor"
                )
        return found

    def _what(self, port: _Port) -> str:
        return "model output" if self._single else f"model output {port.name!r}"

    def _check_datatype(self, port: _Port, tensor: torch.Tensor) -> None:
        if port.datatype is not None and tensor.dtype != TORCH_DTYPES[port.datatype]:
            got = oip_datatype(tensor.dtype) or str(tensor.dtype)
            raise SignatureViolation(
                f"{self._what(port)} is {got}, the signature says {port.datatype}"
            )

    def _check_array_datatype(self, port: _Port, result: np.ndarray) -> None:
        if port.dtype is not None and result.dtype != port.dtype:
            raise SignatureViolation(
                f"{self._what(port)} is {result.dtype}, the signature says {port.datatype}"
            )

    def _check_dims(self, port: _Port, result: np.ndarray) -> None:
        if port.dims is not None and (result.ndim < 1 or tuple(result.shape[1:]) != port.dims):
            rows = list(result.shape[1:]) if result.ndim else "a scalar"
            raise SignatureViolation(
                f"{self._what(port)} rows are {rows}, expected {list(port.dims)}"
            )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return tensor
        rows = tensor.shape[0]
        if self._pinned is not None and rows <= self._pinned.shape[0]:
            staged = self._pinned[:rows]
            staged.copy_(tensor)
            return staged.to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def _pin_threads(self) -> None:
        # Intra-op thread counts are per calling thread under OpenMP, so set them in the
        # thread that actually runs the model, once.
        if self.num_threads is None:
            return
        ident = threading.get_ident()
        if ident not in self._threads_set:
            torch.set_num_threads(self.num_threads)
            self._threads_set.add(ident)

    def zeros(self, rows: int, fill: int = 0) -> Rows:
        """`rows` rows of every input filled with `fill` (0 or 1): warm-up and probe input."""
        arrays: dict[str, np.ndarray] = {}
        for port in self._inputs:
            dtype = port.dtype if port.dtype is not None else self.dtype
            shape = (rows, *(port.dims or ()))
            if port.datatype == "BF16":
                array = to_array(torch.full(shape, fill, dtype=torch.bfloat16))
            else:
                array = np.full(shape, fill, dtype=dtype)
            arrays[port.name] = array
        if self._single:
            return arrays[self._inputs[0].name]
        return NamedRows(arrays)

    def probe(self) -> Rows:
        """Run one batch of two rows (zeros, then ones) and check the answer against the
        signature: what `servemesh models push` does before anything is uploaded.

        Raises SignatureViolation when the outputs do not keep the signature; whatever the
        model itself raises on such input passes through.
        """
        batch = join_rows([self.zeros(1, fill=0), self.zeros(1, fill=1)])
        result = self._forward(batch)
        if row_count(result) != 2:
            raise SignatureViolation(f"model returned {row_count(result)} rows for a batch of 2")
        return result

    def check(self) -> Rows:
        """The readiness check: one batch of the rows the model warmed up on (zeros),
        checked against the signature, and every floating-point output finite.

        Sample rows come from the input shapes because neither the registry's signature nor
        the spec carries sample rows of a model's own. Zeros, because the model answered
        them at warm-up: a model may refuse other values on purpose (an input it validates
        itself), and readiness asks whether it still answers as it did, not whether it
        answers everything; one that now answers NaN or an infinity, or raises, or hangs, has
        changed. The injected latency (a drill knob) is not slept: a slow replica is the
        deadlines' and Envoy's outlier detection's business, not readiness's. Raises
        SignatureViolation or NonFiniteOutput; whatever the model itself raises passes
        through.
        """
        result = self._forward(self.zeros(1))
        if row_count(result) != 1:
            raise SignatureViolation(f"model returned {row_count(result)} rows for a batch of 1")
        for port in self._outputs:
            array = result if isinstance(result, np.ndarray) else result[port.name]
            if not _all_finite(array, port.datatype):
                raise NonFiniteOutput(
                    f"{self._what(port)} is not finite (NaN or infinity) on the sample rows"
                )
        return result

    def warm_up(self, sizes: Iterable[int]) -> dict[int, float]:
        """Run zeros at each batch size; returns the seconds per batch expected at each.

        The injected latency is added to the measured time rather than slept, so a drill
        replica does not spend seconds warming up yet its deadline checks know it is slow.
        """
        timings: dict[int, float] = {}
        for size in sorted(set(sizes)):
            batch = self.zeros(size)
            best = float("inf")
            for _ in range(_WARM_UP_RUNS):
                started = time.perf_counter()
                result = self._forward(batch)
                best = min(best, time.perf_counter() - started)
            if row_count(result) != size:
                raise SignatureViolation(
                    f"model returned {row_count(result)} rows for a batch of {size}"
                )
            timings[size] = best + self.inject_latency_s
        log.info(
            "model warmed up",
            extra={
                "model": self.model,
                "version": self.version,
                "device": str(self.device),
                "expected_ms": {size: round(s * 1000, 3) for size, s in timings.items()},
            },
        )
        return timings


# bfloat16 travels as its uint16 bit patterns (`to_array`): all exponent bits set is an
# infinity or a NaN.
_BF16_EXPONENT = 0x7F80


def _all_finite(array: np.ndarray, datatype: str | None) -> bool:
    """No NaN and no infinity in `array` (integer and boolean outputs always pass)."""
    if datatype == "BF16":
        bits = array.view(np.uint16)
        return not bool(np.any((bits & _BF16_EXPONENT) == _BF16_EXPONENT))
    if array.dtype.kind in "fc":
        return bool(np.isfinite(array).all())
    return True
