"""One loaded TorchScript module for one (model, version), and the forward pass on a batch."""

from __future__ import annotations

import hashlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

# The demo box has 2 cores shared by Envoy, the gateway, the feature service, Redis and the
# model servers. Intra-op threads buy little for a small MLP at batch <= 64 and, when every
# replica spreads over all cores, they oversubscribe the CPU and turn into tail latency.
# Throughput comes from batching and replicas instead; raise it on a bigger machine.
DEFAULT_NUM_THREADS = 1

_WARM_UP_RUNS = 3  # the TorchScript profiling executor specialises on the first calls


class ArtifactMismatch(Exception):
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
    """A TorchScript module ready to run batches in inference mode.

    `run` is called from the batcher's single worker thread, never from the event loop. On
    CUDA the batch is staged in pinned host memory so the host-to-device copy can be
    asynchronous; the result copy back synchronises the stream, so the staging buffer is
    free again when `run` returns.
    """

    def __init__(
        self,
        module: torch.jit.ScriptModule | torch.nn.Module,
        *,
        model: str,
        version: str,
        row_shape: tuple[int, ...],
        dtype: np.dtype[Any] | type = np.float32,
        output_row_shape: tuple[int, ...] | None = None,
        max_batch_size: int = 64,
        device: torch.device | str | None = None,
        inject_latency_ms: float = 0.0,
        num_threads: int | None = DEFAULT_NUM_THREADS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.model = model
        self.version = version
        self.row_shape = tuple(row_shape)
        self.dtype = np.dtype(dtype)
        self.output_row_shape = tuple(output_row_shape) if output_row_shape is not None else None
        self.max_batch_size = max_batch_size
        self.device = torch.device(device) if device is not None else default_device()
        self.inject_latency_s = inject_latency_ms / 1000.0
        self._sleep = sleep  # how the injected latency is spent (tests pass a recorder)
        self.num_threads = num_threads
        self._module = module.to(self.device).eval()
        self._pinned: torch.Tensor | None = None
        if self.device.type == "cuda":
            self._pinned = torch.empty(
                (max_batch_size, *self.row_shape),
                dtype=torch.from_numpy(np.zeros(0, self.dtype)).dtype,
                pin_memory=True,
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
        row_shape: tuple[int, ...],
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> ModelRunner:
        """Verify the artifact's sha256 (again: defence in depth), then load it.

        Raises ArtifactMismatch before torch ever parses bytes that are not the registry's.
        """
        verify_artifact(data, sha256)
        target = torch.device(device) if device is not None else default_device()
        module = torch.jit.load(io.BytesIO(data), map_location=target)
        return cls(
            module, model=model, version=version, row_shape=row_shape, device=target, **kwargs
        )

    def run(self, batch: np.ndarray) -> np.ndarray:
        """The model's output for `batch` (rows first), as a numpy array on the host.

        Sleeps `inject_latency_ms` first when set: a drill knob that makes every batch slow.
        """
        if self.inject_latency_s:
            self._sleep(self.inject_latency_s)
        return self._forward(batch)

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        self._pin_threads()
        if not batch.flags.writeable:
            # torch.from_numpy refuses to share read-only memory (np.frombuffer views).
            batch = np.array(batch)
        with torch.inference_mode():
            inputs = self._to_device(torch.from_numpy(batch))
            output = self._module(inputs)
            if isinstance(output, (tuple, list)) and len(output) == 1:
                output = output[0]
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"model returned {type(output).__name__}, expected one tensor")
            result = output.detach().cpu().numpy()
        wanted = self.output_row_shape
        if wanted is not None and tuple(result.shape[1:]) != wanted:
            raise ValueError(
                f"model output rows are {list(result.shape[1:])}, expected {list(wanted)}"
            )
        return result

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

    def warm_up(self, sizes: Iterable[int]) -> dict[int, float]:
        """Run zeros at each batch size; returns the seconds per batch expected at each.

        The injected latency is added to the measured time rather than slept, so a drill
        replica does not spend seconds warming up yet its deadline checks know it is slow.
        """
        timings: dict[int, float] = {}
        for size in sorted(set(sizes)):
            batch = np.zeros((size, *self.row_shape), dtype=self.dtype)
            best = float("inf")
            for _ in range(_WARM_UP_RUNS):
                started = time.perf_counter()
                result = self._forward(batch)
                best = min(best, time.perf_counter() - started)
            if result.shape[0] != size:
                raise ValueError(f"model returned {result.shape[0]} rows for a batch of {size}")
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
