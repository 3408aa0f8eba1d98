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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib import metadata

import grpc

from servemesh.services.model.errors import ServingError
from servemesh.services.model.inference import infer, model_metadata, routing_headers
from servemesh.services.model.loader import ModelLoader
from servemesh.services.model.repository import Key, ModelRepository
from servemesh.services.model.statistics import model_statistics
from servemesh.services.runtime import DeadlineBudget, bind_request_id
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

SERVER_NAME = "servemesh"
EXTENSIONS = ("model_repository", "statistics")


def _server_version() -> str:
    try:
        return metadata.version("servemesh")
    except metadata.PackageNotFoundError:
        return "0"


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
    ) -> None:
        self.replica = replica
        self.zone = zone
        self.budget = budget or DeadlineBudget()
        self.repository = ModelRepository(loader=loader, expected=expected)
        self.readiness: Callable[[], bool] = self.repository.is_ready
        self._version = _server_version()

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
            name=SERVER_NAME, version=self._version, extensions=list(EXTENSIONS)
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
        request_id, routed_version = routing_headers(context.invocation_metadata())
        bind_request_id(request_id)
        return await infer(
            self.repository,
            request,
            context,
            request_id=request_id,
            routed_version=routed_version,
            replica=self.replica,
            zone=self.zone,
            budget=self.budget,
        )

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
