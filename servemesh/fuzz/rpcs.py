"""Every public RPC the campaign sends to: its path, shape (unary or streaming), which
service answers it, its request class, and whether it is a control call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from google.protobuf.message import Message

from servemesh.contract.wire import (
    CONTROL_METHODS,
    FEATURE_SERVICE,
    GATEWAY_SERVICE,
    OIP_SERVICE,
    REGISTRY_SERVICE,
    method_path,
)
from servemesh_api.feature.v1 import feature_pb2
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.registry.v1 import registry_pb2

Api = Literal["gateway", "model", "feature", "registry"]
Shape = Literal["unary", "client_stream", "server_stream"]


@dataclass(frozen=True)
class Rpc:
    api: Api
    service: str
    method: str
    request: type[Message]
    shape: Shape = "unary"

    @property
    def path(self) -> str:
        return method_path(self.service, self.method)

    @property
    def control(self) -> bool:
        return self.path in CONTROL_METHODS

    @property
    def name(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}/{self.method}"


def _oip(method: str, request: type[Message]) -> Rpc:
    return Rpc("model", OIP_SERVICE, method, request)


RPCS: tuple[Rpc, ...] = (
    Rpc("gateway", GATEWAY_SERVICE, "Predict", gateway_pb2.PredictRequest),
    _oip("ServerLive", oip.ServerLiveRequest),
    _oip("ServerReady", oip.ServerReadyRequest),
    _oip("ModelReady", oip.ModelReadyRequest),
    _oip("ServerMetadata", oip.ServerMetadataRequest),
    _oip("ModelMetadata", oip.ModelMetadataRequest),
    _oip("ModelInfer", oip.ModelInferRequest),
    _oip("ModelStatistics", oip.ModelStatisticsRequest),
    _oip("RepositoryIndex", oip.RepositoryIndexRequest),
    _oip("RepositoryModelLoad", oip.RepositoryModelLoadRequest),
    _oip("RepositoryModelUnload", oip.RepositoryModelUnloadRequest),
    Rpc("feature", FEATURE_SERVICE, "GetFeatures", feature_pb2.GetFeaturesRequest),
    Rpc("feature", FEATURE_SERVICE, "WriteFeatures", feature_pb2.WriteFeaturesRequest),
    Rpc(
        "feature",
        FEATURE_SERVICE,
        "LoadFeatures",
        feature_pb2.LoadFeaturesRequest,
        "client_stream",
    ),
    Rpc("registry", REGISTRY_SERVICE, "CreateModel", registry_pb2.CreateModelRequest),
    Rpc("registry", REGISTRY_SERVICE, "ListModels", registry_pb2.ListModelsRequest),
    Rpc(
        "registry",
        REGISTRY_SERVICE,
        "UploadVersion",
        registry_pb2.UploadVersionRequest,
        "client_stream",
    ),
    Rpc("registry", REGISTRY_SERVICE, "GetVersion", registry_pb2.GetVersionRequest),
    Rpc("registry", REGISTRY_SERVICE, "ListVersions", registry_pb2.ListVersionsRequest),
    Rpc("registry", REGISTRY_SERVICE, "SetAlias", registry_pb2.SetAliasRequest),
    Rpc(
        "registry",
        REGISTRY_SERVICE,
        "DownloadArtifact",
        registry_pb2.DownloadArtifactRequest,
        "server_stream",
    ),
)
