"""The model a batch run scores with: the registry's verified artifact (downloaded with its
sha256 checked, the spec's contract checked, the sha256 checked again), loaded in a
sandboxed child (`servemesh.sandbox`: its own process and user, no secrets, a syscall
filter) through the model servers' own guard and runner, and called there in full batches:
this process sends rows and gets arrays back, and never runs model code.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from servemesh.batch.errors import BatchError
from servemesh.contract.errors import ServemeshError
from servemesh.sandbox.model import SandboxedModel, SandboxedModelError
from servemesh.services.model.artifacts import FORMATS, as_format
from servemesh.services.model.runner import ArtifactMismatch, verify_artifact
from servemesh.services.model.tensors import Signature
from servemesh.spec import MeshSpec
from servemesh.spec.model_contract import check_model_contract

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ViewInput:
    """One model input filled from a view: its tensor, the view and the features."""

    name: str
    view: str
    features: tuple[str, ...]


def view_inputs(spec: MeshSpec, model: str) -> list[ViewInput]:
    """How each input of `model` is filled from its views; BatchError naming the model when
    it is not in the spec or takes an input from the caller (batch runs have no caller)."""
    model_spec = spec.models.get(model)
    if model_spec is None:
        raise BatchError(f"--model {model}: not a model of the spec; its models: "
                         f"{', '.join(sorted(spec.models))}")  # fmt: skip
    found = []
    for name, source in model_spec.effective_inputs.items():
        if source.raw or source.view is None or source.features is None:
            raise BatchError(
                f"--model {model}: input {name!r} is sent by the caller (raw); batch scoring "
                "fills inputs from feature views only"
            )
        found.append(ViewInput(name, source.view, tuple(source.features)))
    return found


def wire_inputs(
    model: str, signature: Signature, matrices: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Each input of `signature`, in its order, as the flat array of its wire datatype (as the
    gateway encodes a caller's tensor); BatchError naming the input when a value does not fit."""
    from servemesh.services.gateway.tensors import to_wire

    wires = {}
    for sig in signature.inputs:
        try:
            wires[sig.name] = to_wire(matrices[sig.name], sig.datatype, f"input {sig.name!r}")
        except ServemeshError as exc:
            raise BatchError(f"--model {model}: {exc}") from None
    return wires


@dataclass(frozen=True)
class Artifact:
    """The verified artifact's bytes, kept for a run that loads the model elsewhere too (a
    distributed run's workers load them with the same allowlisted loader)."""

    data: bytes
    format: str  # "torchscript", "torch_export" or "onnx"


def reply_limit(signature: Signature, rows: int) -> int:
    """The most bytes a sandboxed model's answer to `rows` rows may take: every output's rows
    at their declared dims, and room for the header."""
    per_row = sum(t.row_elements * t.dtype.itemsize for t in signature.outputs)
    return rows * max(per_row, 1) + (1 << 20)


def open_sandboxed(
    data: bytes,
    *,
    model: str,
    version: str,
    sha256: str,
    signature: Signature,
    batch_size: int,
    num_threads: int | None,
    inject_latency_ms: float = 0.0,
) -> SandboxedModel:
    """The verified artifact loaded in a sandboxed child, taking up to `batch_size` rows per
    call; BatchError with the reason when the sha256 does not match or it does not load."""
    where = f"model {model!r} version {version!r}"
    try:
        # Checked again where the bytes are parsed next: nothing but the registry's bytes.
        verify_artifact(data, sha256)
        return SandboxedModel.open(
            data,
            declared=signature,
            model=model,
            version=version,
            max_batch_size=batch_size,
            num_threads=num_threads,
            inject_latency_ms=inject_latency_ms,
            max_reply_bytes=reply_limit(signature, batch_size),
        )
    except (ArtifactMismatch, SandboxedModelError) as exc:
        raise BatchError(f"{where}: {exc}") from None


@dataclass
class Scorer:
    """The model a run scores with. `sandboxed`: the child that runs it (None until opened:
    a run whose rows are scored elsewhere, a Dask cluster or the mesh, never opens one)."""

    model: str
    version: str
    sha256: str
    signature: Signature
    inputs: list[ViewInput]
    artifact: Artifact | None = None
    sandboxed: SandboxedModel | None = None
    num_threads: int | None = None
    inject_latency_ms: float = 0.0
    # A child answers one call at a time.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.signature.outputs]

    @property
    def batch_size(self) -> int:
        """The most rows one call of the child takes."""
        return self.sandboxed.max_batch_size if self.sandboxed is not None else 0

    def score(self, matrices: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every output of the model for the rows of `matrices` (float32, by input name),
        as the model answers them in its sandbox; called from a worker thread, one batch at
        a time. BatchError when the model fails or its child dies."""
        if self.sandboxed is None:
            raise BatchError(f"--model {self.model}: the model is not loaded in this process")
        wires = wire_inputs(self.model, self.signature, matrices)
        arrays = {
            sig.name: wires[sig.name].reshape(len(matrices[sig.name]), *sig.dims)
            for sig in self.signature.inputs
        }
        try:
            with self._lock:
                answer = self.sandboxed.run(arrays)
        except SandboxedModelError as exc:
            raise BatchError(f"model {self.model!r} version {self.version!r}: {exc}") from None
        return {name: answer[name] for name in self.output_names}

    def score_batches(
        self, matrices: Mapping[str, np.ndarray], batch_size: int
    ) -> dict[str, np.ndarray]:
        """`score` over the rows of `matrices` in model batches of `batch_size` rows (the
        last one shorter), the outputs joined in row order: a chunk read and written as one
        is scored as many batches, in one call of a worker thread."""
        if self.sandboxed is not None:
            batch_size = min(batch_size, self.sandboxed.max_batch_size)
        n = len(next(iter(matrices.values())))
        if n <= batch_size:
            return self.score(matrices)
        parts = [
            self.score({name: m[start : start + batch_size] for name, m in matrices.items()})
            for start in range(0, n, batch_size)
        ]
        return {name: np.concatenate([p[name] for p in parts]) for name in self.output_names}

    def close(self) -> None:
        """End the child (by its PID), if one was opened."""
        sandboxed, self.sandboxed = self.sandboxed, None
        if sandboxed is not None:
            sandboxed.close()


async def load_scorer(
    channel: grpc.aio.Channel,
    spec: MeshSpec,
    model: str,
    version: str,
    *,
    num_threads: int | None = None,
    device: str | None = None,
    retry_for_s: float = 5.0,
    keep_artifact: bool = False,
    batch_size: int | None = None,
) -> Scorer:
    """The model `model` at `version` (a version or an alias) from the registry behind
    `channel`; BatchError with the reason when it does not load. `batch_size`: open the
    sandboxed child that scores, taking up to that many rows per call (None: open none, the
    rows are scored elsewhere). `keep_artifact`: the Scorer keeps the verified bytes.
    `device`: the child runs on the CPU (its filter opens no device read-write); "cpu" or
    None only."""
    if device not in (None, "cpu"):
        raise BatchError(
            f"--device {device}: batch scoring runs the model in a sandboxed child on the CPU"
        )
    inputs = view_inputs(spec, model)
    record, data = await _fetch(channel, spec, model, version, retry_for_s)
    where = f"model {model!r} version {version!r}"
    if record.format not in FORMATS:
        raise BatchError(f"{where}: format {record.format!r} is not one of {list(FORMATS)}")
    if record.size_bytes and len(data) != record.size_bytes:
        raise BatchError(
            f"{where}: artifact is {len(data)} bytes, registry says {record.size_bytes}"
        )
    try:
        signature = Signature.from_specs(record.inputs, record.outputs, where=f"{where} signature")
    except ValueError as exc:
        raise BatchError(str(exc)) from None
    model_spec = spec.models.get(model)
    inject_latency_ms = 0.0
    if model_spec is not None:
        # The checks a model server's loader makes: every input the spec fills from a view
        # has its width, every input of the signature is filled.
        problems = check_model_contract(model, model_spec, record.inputs, record.outputs)
        if problems:
            raise BatchError(f"{where}: " + "; ".join(problems))
        version_spec = model_spec.versions.get(record.version or version)
        inject_latency_ms = version_spec.inject_latency_ms if version_spec else 0.0
    # An alias ("latest") resolves to the version the registry answered with.
    resolved = record.version or version
    kind = as_format(record.format)
    scorer = Scorer(
        model=model,
        version=resolved,
        sha256=record.sha256,
        signature=signature,
        inputs=inputs,
        artifact=Artifact(data, kind) if keep_artifact else None,
        num_threads=num_threads,
        inject_latency_ms=inject_latency_ms,
    )
    if batch_size is not None:
        # Started from a thread (seconds: an interpreter and torch), the loop answering.
        scorer.sandboxed = await asyncio.to_thread(
            open_sandboxed,
            data,
            model=model,
            version=resolved,
            sha256=record.sha256,
            signature=signature,
            batch_size=batch_size,
            num_threads=num_threads,
            inject_latency_ms=inject_latency_ms,
        )
    return scorer


async def _fetch(
    channel: grpc.aio.Channel, spec: MeshSpec, model: str, version: str, retry_for_s: float
) -> tuple[Any, bytes]:
    """The version's record and bytes (sha256-verified by the client), fetched as a model
    server fetches them (an unreachable registry retried with backoff for `retry_for_s`)."""
    from servemesh.registry.client import fetch_verified
    from servemesh.services.model.errors import LoadError
    from servemesh.services.model.loader import fetch_with_retry

    try:
        return await fetch_with_retry(fetch_verified, channel, model, version, spec, retry_for_s)
    except LoadError as exc:
        raise BatchError(str(exc)) from None
    except Exception as exc:
        # The client's own checks: a size or sha256 mismatch in transit, over the limit.
        raise BatchError(f"model {model!r} version {version!r}: {exc}") from None
