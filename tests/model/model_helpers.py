"""Helpers shared by the model server tests (imported by name: tests/ has no packages).

Scheduling tests never sleep to put events in order. A GatedModel holds each batch at the
model's door until the test lets it through, so "the model is busy now" is a fact the test
waits for (`entered`); an AnnouncingBatcher tells the test each request it admitted, so
"these requests are queued" is one too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import numpy as np
import torch

from servemesh.contract.demo import Artifact
from servemesh.identity import dial_address, serving_credentials
from servemesh.services.model.app import SERVICE_NAME
from servemesh.services.model.batching import MONOTONIC, Batcher, BatchRunner, Clock, Rows
from servemesh.services.model.loader import LoadedModel, warm_up_sizes
from servemesh.services.model.runner import ModelRunner
from servemesh.services.model.service import InferenceServicer
from servemesh.services.model.tensors import Signature, TensorSig
from servemesh.services.runtime import ServiceServer
from servemesh.spec import BatchingSpec, MeshSpec
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.control_kit import TEST_TOKEN, credentialed_channel

FEATURES = 64
SIGNATURE = Signature(
    input=TensorSig("features", "FP32", (-1, FEATURES)),
    output=TensorSig("score", "FP32", (-1, 1)),
)
# A batch the test never lets through fails after this long instead of hanging the run.
GATE_TIMEOUT_S = 30.0
REPLICA = "model-fraud-zone-a-0"
Stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub


@asynccontextmanager
async def serving_at(
    servicer: InferenceServicer, spec: MeshSpec | None = None
) -> AsyncIterator[tuple[Stub, int]]:
    """`servicer` on a real grpc.aio server on 127.0.0.1 (a free port): a stub, and the port.
    With `spec`, the port is mutual TLS with REPLICA's certificate of that mesh, as in a
    running one, and the stub dials it as the operator."""
    credentials = serving_credentials(spec, REPLICA) if spec is not None else None
    server = ServiceServer(
        REPLICA, port=0, drain_grace_s=1.0, control_token=TEST_TOKEN, credentials=credentials
    )
    server.add_service(
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, servicer, SERVICE_NAME
    )
    server.on_stop(servicer.repository.close)
    port = await server.start()
    address = f"127.0.0.1:{port}"
    channel = credentialed_channel(
        address if spec is None else dial_address(spec, address, REPLICA)
    )
    try:
        yield Stub(channel), port
    finally:
        await channel.close()
        await server.drain()


@asynccontextmanager
async def serving(servicer: InferenceServicer) -> AsyncIterator[tuple[Stub, None]]:
    """`servicer` on a real grpc.aio server on 127.0.0.1 (a free port), and a stub to it."""
    async with serving_at(servicer) as (stub, _):
        yield stub, None


def rows(n: int, seed: int = 0) -> np.ndarray:
    """n random feature rows, float32."""
    return np.random.default_rng(seed).normal(size=(n, FEATURES)).astype(np.float32)


def array_of(answer: Rows | BaseException) -> np.ndarray:
    """A demo model's rows: it takes and gives one tensor, so they are one array."""
    assert isinstance(answer, np.ndarray), answer
    return answer


def marked(value: float, n: int = 1) -> np.ndarray:
    """n rows filled with `value`: a request the model's input log can be searched for."""
    return np.full((n, FEATURES), value, dtype=np.float32)


def reference_scores(module: torch.jit.ScriptModule, batch: np.ndarray) -> np.ndarray:
    """Scores of `batch` computed one row at a time, straight through TorchScript."""
    with torch.inference_mode():
        return np.concatenate(
            [module(torch.from_numpy(row[None, :].copy())).numpy() for row in batch]
        )


def demo_runner(
    artifact: Artifact, max_batch_size: int = 64, inject_latency_ms: float = 0.0
) -> ModelRunner:
    """A TorchScript artifact loaded the way the server loads it (sha256 checked)."""
    return ModelRunner.from_bytes(
        artifact.data,
        sha256=artifact.sha256,
        model="fraud",
        version="v1",
        row_shape=(FEATURES,),
        output_row_shape=(1,),
        max_batch_size=max_batch_size,
        inject_latency_ms=inject_latency_ms,
    )


class GatedModel:
    """A real runner behind a gate: each batch announces itself, then waits to be let in.

    `run` (in the batcher's worker thread) records the batch and the clock's reading, and,
    while the gate is held, puts the batch on `entered` and blocks until `release` (one
    batch) or `open` (every batch from then on). Create it on the event loop.
    """

    def __init__(self, runner: ModelRunner, clock: Clock = MONOTONIC, *, held: bool) -> None:
        self.runner = runner
        self.clock = clock
        self.batches: list[np.ndarray] = []
        self.started: list[float] = []  # clock reading when each batch reached the model
        self._loop = asyncio.get_running_loop()
        self._entered: asyncio.Queue[np.ndarray] = asyncio.Queue()
        self._passes = threading.Semaphore(0)
        self._open = threading.Event()
        if not held:
            self._open.set()

    def run(self, batch: Rows) -> Rows:
        batch = array_of(batch)
        self.started.append(self.clock.now())
        self.batches.append(batch.copy())
        if not self._open.is_set():
            self._loop.call_soon_threadsafe(self._entered.put_nowait, batch.copy())
            if not self._passes.acquire(timeout=GATE_TIMEOUT_S):
                raise RuntimeError("the test never let this batch into the model")
        return self.runner.run(batch)

    def warm_up(self, sizes: Iterable[int]) -> dict[int, float]:
        return self.runner.warm_up(sizes)

    async def entered(self) -> np.ndarray:
        """The next batch held at the door (waits until one arrives)."""
        return await self._entered.get()

    def release(self) -> None:
        """Let the held batch into the model."""
        self._passes.release()

    def open(self) -> None:
        """Let the held batch and every later one through."""
        self._open.set()
        self._passes.release()

    def saw(self, marker: float) -> bool:
        return any(bool((batch == marker).all(axis=1).any()) for batch in self.batches)

    def order(self, markers: list[float]) -> list[float]:
        """The markers in the order their rows reached the model."""
        seen = [float(row[0]) for batch in self.batches for row in batch]
        return [value for value in seen if value in markers]


class AnnouncingBatcher(Batcher):
    """The real batcher; puts the id of every request it admits on `admitted`."""

    def __init__(
        self, runner: BatchRunner, batching: BatchingSpec, *, name: str, clock: Clock = MONOTONIC
    ) -> None:
        super().__init__(runner, batching, name=name, clock=clock)
        self.admitted: asyncio.Queue[str] = asyncio.Queue()

    def enqueue(
        self, rows: Rows, deadline: float, request_id: str, priority: int = 0, caller: str = ""
    ) -> asyncio.Future[Rows]:
        answer = super().enqueue(rows, deadline, request_id, priority, caller)
        self.admitted.put_nowait(request_id)
        return answer


class GatedLoader:
    """A ModelLoader for fraud v1/v2 from the demo artifacts, each behind a held gate.

    After a load, `models[version]` is its gate and `batchers[version]` its batcher.
    """

    def __init__(
        self,
        artifacts: dict[int, Artifact],
        batching: BatchingSpec | None = None,
        *,
        inject_latency_ms: float = 0.0,
    ) -> None:
        self.artifacts = artifacts
        self.batching = batching or BatchingSpec()
        self.inject_latency_ms = inject_latency_ms
        self.models: dict[str, GatedModel] = {}
        self.batchers: dict[str, AnnouncingBatcher] = {}

    async def __call__(self, model: str, version: str) -> LoadedModel:
        seed = {"v1": 1, "v2": 2}[version]
        artifact = self.artifacts[seed]
        runner = demo_runner(artifact, self.batching.max_batch_size, self.inject_latency_ms)
        gate = GatedModel(runner, held=True)
        batcher = AnnouncingBatcher(gate, self.batching, name=f"{model}:{version}")
        await batcher.warm_up(warm_up_sizes(self.batching))
        self.models[version], self.batchers[version] = gate, batcher
        return LoadedModel(
            model=model,
            version=version,
            signature=SIGNATURE,
            batching=self.batching,
            runner=runner,
            batcher=batcher,
            sha256=artifact.sha256,
        )
