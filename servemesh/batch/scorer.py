"""The model a batch run scores with: the registry's verified artifact, loaded by the model
servers' own loader (services/model/loader.py: download with the sha256 checked, the spec's
contract checked, the operator allowlist applied, the sha256 checked again before torch
parses a byte, warm-up), then called in full batches in this process.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from servemesh.batch.errors import BatchError
from servemesh.errors import ServemeshError
from servemesh.services.model.batching.rows import NamedRows
from servemesh.services.model.loader import registry_loader
from servemesh.services.model.runner import ModelRunner
from servemesh.services.model.tensors import Signature
from servemesh.spec import MeshSpec

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
    format: str  # "torchscript" or "torch_export"


@dataclass
class Scorer:
    model: str
    version: str
    sha256: str
    signature: Signature
    runner: ModelRunner
    inputs: list[ViewInput]
    artifact: Artifact | None = None

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.signature.outputs]

    def score(self, matrices: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every output of the model for the rows of `matrices` (float32, by input name),
        as the model answers them; called from a worker thread, one batch at a time."""
        wires = wire_inputs(self.model, self.signature, matrices)
        arrays = {
            sig.name: wires[sig.name].reshape(len(matrices[sig.name]), *sig.dims)
            for sig in self.signature.inputs
        }
        if self.runner.single:
            (only,) = arrays.values()
            return {self.output_names[0]: np.asarray(self.runner.run(only))}
        answer = self.runner.run(NamedRows(arrays))
        assert isinstance(answer, NamedRows)
        return {name: np.asarray(answer[name]) for name in self.output_names}

    def score_batches(
        self, matrices: Mapping[str, np.ndarray], batch_size: int
    ) -> dict[str, np.ndarray]:
        """`score` over the rows of `matrices` in model batches of `batch_size` rows (the
        last one shorter), the outputs joined in row order: a chunk read and written as one
        is scored as many batches, in one call of a worker thread."""
        n = len(next(iter(matrices.values())))
        if n <= batch_size:
            return self.score(matrices)
        parts = [
            self.score({name: m[start : start + batch_size] for name, m in matrices.items()})
            for start in range(0, n, batch_size)
        ]
        return {name: np.concatenate([p[name] for p in parts]) for name in self.output_names}


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
) -> Scorer:
    """The model `model` at `version` (a version or an alias) from the registry behind
    `channel`; BatchError with the loader's reason when it does not load. `keep_artifact`:
    the Scorer keeps the verified bytes it was loaded from."""
    inputs = view_inputs(spec, model)
    fetched: list[tuple[Any, bytes]] = []

    async def fetch(*args: Any, **kwargs: Any) -> tuple[Any, bytes]:
        from servemesh.registry.client import fetch_verified

        record, data = await fetch_verified(*args, **kwargs)
        fetched[:] = [(record, data)]
        return record, data

    load = registry_loader(
        channel,
        spec,
        device=device,
        retry_for_s=retry_for_s,
        fetch=fetch if keep_artifact else None,
    )
    try:
        loaded = await load(model, version)
    except ServemeshError as exc:
        raise BatchError(str(exc)) from None
    # The batcher served warm-up; a batch run calls the runner itself, in full batches.
    await loaded.close()
    runner = loaded.runner
    # A batch run owns its process: torch may use every core (None: torch's own default).
    runner.num_threads = num_threads
    artifact = None
    if keep_artifact:
        ((record, data),) = fetched
        # The bytes the loader verified and loaded: the same sha256, checked again where
        # they are loaded next.
        kind = "torch_export" if record.format == "torch_export" else "torchscript"
        artifact = Artifact(data, kind)
    return Scorer(
        model=model,
        version=loaded.version,
        sha256=loaded.sha256,
        signature=loaded.signature,
        runner=runner,
        inputs=inputs,
        artifact=artifact,
    )
