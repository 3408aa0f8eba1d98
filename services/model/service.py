"""The OIP v2 gRPC servicer of one replica: every RPC of GRPCInferenceService, each handed on.

| RPCs | where |
| --- | --- |
| ServerLive, ServerReady, ModelReady, ServerMetadata | here |
| ModelInfer, ModelMetadata | `inference` |
| RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload | `repository` |
| ModelStatistics | `statistics` |

No handler maps errors: each raises from the tree in services/model/errors.py, and the
runtime's ErrorStatusInterceptor (installed by every ServiceServer) answers with its status.
A bad request never crashes the replica.

Admission control: ModelInfer admits at most `max_in_flight` calls at once and refuses the
next with RESOURCE_EXHAUSTED at its first line, before the request is read, validated or
queued. Under overload the queue then stays in front of a cheap refusal instead of growing
in the event loop, where every call would cost a full answer's CPU and most would be
answered after their callers gave up (docs/benchmarks.md, "The deadline mix").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc

from servemesh.services.model.errors import Overloaded, ServingError
from servemesh.services.model.inference import infer, model_metadata, routing_headers
from servemesh.services.model.loader import ModelLoader
from servemesh.services.model.repository import Key, ModelRepository
from servemesh.services.model.shadow import ROLES, ShadowRecorder
from servemesh.services.model.statistics import model_statistics
from servemesh.services.runtime import DeadlineBudget, bind_request_id
from servemesh.services.runtime.oip_server import SERVER_NAME, server_version
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

EXTENSIONS = ("model_repository", "statistics")
# ModelInfer calls one replica holds at once before it refuses more (admission control).
# Above any closed loop the bench and the mesh run (64 callers), and a replica answers
# ~128 calls in ~40-60 ms on one core: a 1 s caller admitted at the limit is still answered
# in time, and a refused one is retried elsewhere by Envoy at once.
MAX_IN_FLIGHT = 128


class InferenceServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """GRPCInferenceService for the models in `repository`, built from `loader`/`expected`.

    ServerReady answers `readiness()` when the server wires one in (the model server's
    health rule, see `readiness`), else whether every expected version is served.
    """

    def __init__(
        self,
        *,
        replica: str,
        zone: str = "",
        loader: ModelLoader | None = None,
        expected: Iterable[Key] = (),
        budget: DeadlineBudget | None = None,
        shadow: ShadowRecorder | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.replica = replica
        self.zone = zone
        self.budget = budget or DeadlineBudget()
        self.repository = ModelRepository(loader=loader, expected=expected)
        self.readiness: Callable[[], bool] = self.repository.is_ready
        self.shadow = shadow
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # ModelInfer calls admitted and not yet answered

    # --- health and metadata --------------------------------------------------------

    async def ServerLive(
        self, request: oip.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: oip.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=self.readiness())

    async def ModelReady(
        self, request: oip.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelReadyResponse:
        try:
            self.repository.resolve(request.name, request.version)
        except ServingError:
            return oip.ModelReadyResponse(ready=False)
        return oip.ModelReadyResponse(ready=True)

    async def ServerMetadata(
        self, request: oip.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerMetadataResponse:
        return oip.ServerMetadataResponse(
            name=SERVER_NAME, version=server_version(), extensions=list(EXTENSIONS)
        )

    async def ModelMetadata(
        self, request: oip.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelMetadataResponse:
        loaded = self.repository.resolve(request.name, request.version)
        return model_metadata(loaded, self.repository.versions_of(loaded.model))

    # --- inference --------------------------------------------------------------------

    async def ModelInfer(
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        if self.in_flight >= self.max_in_flight:
            raise Overloaded(
                f"replica {self.replica} is at its limit of {self.max_in_flight} "
                "concurrent ModelInfer calls"
            )
        self.in_flight += 1
        try:
            request_id, routed_version, role = routing_headers(context.invocation_metadata())
            bind_request_id(request_id)
            answer = infer(
                self.repository,
                request,
                context,
                request_id=request_id,
                routed_version=routed_version,
                replica=self.replica,
                zone=self.zone,
                budget=self.budget,
                # The connection's peer (Envoy's mesh listener for a routed call, a tool's
                # address for a direct one); the request id ties it to the gateway's call.
                caller=context.peer() or "",
            )
            if self.shadow is not None and role in ROLES:
                return await self.shadow.record(role, request_id, routed_version, request, answer)
            return await answer
        finally:
            self.in_flight -= 1

    # --- extensions: statistics and the model repository ----------------------------

    async def ModelStatistics(
        self, request: oip.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelStatisticsResponse:
        return model_statistics(self.repository, request)

    async def RepositoryIndex(
        self, request: oip.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> oip.RepositoryIndexResponse:
        return self.repository.index(request)

    async def RepositoryModelLoad(
        self, request: oip.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> oip.RepositoryModelLoadResponse:
        await self.repository.load_requested(request)
        return oip.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: oip.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> oip.RepositoryModelUnloadResponse:
        await self.repository.unload_requested(request)
        return oip.RepositoryModelUnloadResponse()
