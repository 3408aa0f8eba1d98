"""`--through-mesh`: a batch run's rows scored by the running mesh's model servers.

The command reads, selects, writes and checkpoints exactly as an in-process run does (the
same chunks, the same `chunk.select_chunk`); only the forward passes move: each batch of a
chunk is one OIP ModelInfer, sent through a zone's Envoy mesh listener with the model and
version headers (the version the run pinned and loaded from the registry: the output
records that artifact's sha256, and every model server hosts every version of the spec),
at the model's lowest batcher priority: OIP's `priority` parameter set to
`batching.priority_levels`, so each model server's batcher serves every queued online
request (level `default_priority_level`, 1 unless the spec says otherwise) before a batch
row, and online traffic keeps its latency.

Why the mesh listener and not the replicas' own ports: Envoy already balances a version's
calls over its replicas in every zone (the local zone first), ejects a failing one, and
follows replicas added or removed live; the run needs to know none of it, and it reaches
the model servers the way the gateways do (mutual TLS, as the operator), so the mesh's
routes, limits and metrics see batch traffic as what it is. At most IN_FLIGHT requests are
out at once: a batch run takes a bounded share of the servers' queues, never all of them;
and fewer as online traffic rises, down to one a tenth of the time (yielding.py: the run
follows its own calls' latency, as a scavenger transport does, and gives way while the
mesh is busy).

A request refused for load (RESOURCE_EXHAUSTED: a full queue, UNAVAILABLE: no replica
just now) is sent again after a backoff; scoring is a pure function of the rows, so an
answer sent twice is the same answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
import numpy as np

from servemesh.batch.errors import BatchError
from servemesh.batch.scorer import Scorer, wire_inputs
from servemesh.batch.yielding import YieldingGate, YieldingWindow
from servemesh.contract.errors import ServemeshError
from servemesh.contract.wire import MODEL_HEADER, REQUEST_ID_HEADER, VERSION_HEADER
from servemesh.services.model.tensors import Signature
from servemesh.spec import MeshSpec
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

IN_FLIGHT = 4
CALL_TIMEOUT_S = 60.0
RETRIES = 8
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 2.0
_RETRIED = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


@dataclass
class MeshModel:
    """One model version served by the mesh, called in batches from a batch run."""

    model: str
    version: str
    signature: Signature
    priority: int  # the OIP priority level batch rows are queued at
    stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub
    run_id: str
    gate: YieldingGate
    sent: int = 0

    def request(self, matrices: Mapping[str, np.ndarray]) -> oip.ModelInferRequest:
        """One ModelInfer for the rows of `matrices`, raw little-endian tensors."""
        request = oip.ModelInferRequest(model_name=self.model, model_version=self.version)
        request.parameters["priority"].int64_param = self.priority
        wires = wire_inputs(self.model, self.signature, matrices)
        for sig in self.signature.inputs:
            rows = len(matrices[sig.name])
            request.inputs.add(name=sig.name, datatype=sig.datatype, shape=[rows, *sig.dims])
            request.raw_input_contents.append(wires[sig.name].tobytes())
        return request

    async def score(self, matrices: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every output for the rows of `matrices`, from one model server's answer."""
        from servemesh.services.gateway.tensors import decode_output

        n = len(next(iter(matrices.values())))
        request = self.request(matrices)
        self.sent += 1
        metadata = (
            (MODEL_HEADER, self.model),
            (VERSION_HEADER, self.version),
            (REQUEST_ID_HEADER, f"{self.run_id}-{self.sent}"),
        )
        delay = RETRY_FIRST_S
        for attempt in range(RETRIES + 1):
            try:
                async with self.gate.slot():
                    response = await self.stub.ModelInfer(
                        request, metadata=metadata, timeout=CALL_TIMEOUT_S
                    )
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _RETRIED:
                    self.gate.window.refused()
                if exc.code() not in _RETRIED or attempt == RETRIES:
                    raise BatchError(
                        f"--through-mesh: {self.model} {self.version}: {exc.code().name}: "
                        f"{exc.details()}"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        if response.model_version != self.version:
            raise BatchError(
                f"--through-mesh: asked {self.model} {self.version}, answered by version "
                f"{response.model_version!r}"
            )
        found = {}
        try:
            for index, output in enumerate(response.outputs):
                found[output.name] = decode_output(response, index)
        except ServemeshError as exc:
            raise BatchError(f"--through-mesh: {self.model} {self.version}: {exc}") from None
        outputs = {}
        for sig in self.signature.outputs:
            values = found.get(sig.name)
            if values is None or len(values) != n:
                raise BatchError(
                    f"--through-mesh: {self.model} {self.version} answered no output "
                    f"{sig.name!r} for {n} rows"
                )
            outputs[sig.name] = values
        return outputs

    async def score_batches(
        self, matrices: Mapping[str, np.ndarray], batch_size: int
    ) -> dict[str, np.ndarray]:
        """The rows of `matrices` as requests of `batch_size` rows, in flight together (as many
        as the run's gate lets out), the outputs joined in row order."""
        n = len(next(iter(matrices.values())))
        parts = await asyncio.gather(
            *(
                self.score({name: m[start : start + batch_size] for name, m in matrices.items()})
                for start in range(0, n, batch_size)
            )
        )
        names = [t.name for t in self.signature.outputs]
        return {name: np.concatenate([p[name] for p in parts]) for name in names}


def mesh_model(
    spec: MeshSpec,
    scorer: Scorer,
    channel: grpc.aio.Channel,
    batch_size: int,
    run_id: str,
    *,
    greedy: bool = False,
) -> MeshModel:
    """The scorer's model version as the mesh serves it, over `channel` (a zone's mesh
    listener); BatchError when a batch is more rows than a model server takes at once.
    `greedy`: IN_FLIGHT requests out whatever their latency (no yielding to online calls)."""
    batching = spec.models[scorer.model].batching
    if batch_size > batching.max_rows_per_request:
        raise BatchError(
            f"--batch-size {batch_size}: the model servers take at most "
            f"{batching.max_rows_per_request} rows per request (models.{scorer.model}."
            "batching.max_rows_per_request)"
        )
    return MeshModel(
        model=scorer.model,
        version=scorer.version,
        signature=scorer.signature,
        priority=batching.priority_levels,
        stub=grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel),
        run_id=run_id,
        gate=YieldingGate(YieldingWindow(IN_FLIGHT, fixed=greedy)),
    )
