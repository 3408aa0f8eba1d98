"""The Open Inference Protocol at the edge: the calls an OIP client (tritonclient, a KServe
client, `curl` on the REST paths Envoy transcodes) makes of the mesh, answered by the
gateway.

A model server speaks OIP itself, but only inside the mesh: the edge routes every call to
the gateways. So the gateway answers the protocol's server calls itself and passes the
model calls on through its zone's Envoy, routed by the model header exactly as Predict's
own ModelInfer calls are (the version split, a pinned version, retries, the other zone on
failure). What Predict adds on the way, an OIP call does not get: no feature read (the
caller sends the tensors), no fallback answer, no prediction log record. What it keeps:
the edge's TLS, auth and limits, the deadline, the request id and trace, and the rule that
only operators pin a version the split gives 0%.

Methods answered: ServerLive, ServerReady (a model server's readiness, through the mesh),
ServerMetadata, ModelReady, ModelMetadata, ModelInfer. The statistics and model-repository
extensions are operators' calls to a model server, not callers': UNIMPLEMENTED here.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
from google.protobuf.message import Message

from servemesh.contract.wire import (
    MODEL_HEADER,
    OIP_SERVICE,
    ROUTE_PINNED,
    ROUTE_ROUTED,
    VERSION_HEADER,
    lost_the_mesh_listener,
    method_path,
)
from servemesh.services.gateway.callers import caller_of, check_pin
from servemesh.services.gateway.service import (
    GatewayServicer,
    downstream_metadata,
    routed_version,
)
from servemesh.services.runtime import request_id_from
from servemesh.services.runtime.errors import InvalidArgument, MeshError, NotFound
from servemesh.services.runtime.oip_server import SERVER_NAME, server_version
from servemesh.services.runtime.tracing import traced_call
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

# OIP's (Triton's) queue-level parameter, which model servers honour (services/model).
PRIORITY_PARAMETER = "priority"


class ForwardFailed(MeshError):
    """A forwarded call's failure, its status passed back as the model server (or Envoy)
    gave it, with the version Envoy routed it to ("" when it did not say)."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(error.details() or error.code().name, code=error.code())
        self.routed_version = routed_version(error)
        # The zone's mesh listener refused or dropped the call: it never left this zone.
        self.path_lost = lost_the_mesh_listener(error.code().name, error.details() or "")


class EdgeInference(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """OIP for callers at the edge, over the gateway's channel to its zone's Envoy."""

    def __init__(self, gateway: GatewayServicer) -> None:
        # The gateway's spec (it follows `servemesh apply`), its model stub and deadline budget.
        self.gateway = gateway

    async def ServerLive(
        self, request: oip.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: oip.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerReadyResponse:
        # No model header: Envoy's route for any model server, so "ready" is the mesh's
        # answer, not only this gateway's.
        return await self._forward("ServerReady", request, [], context)

    async def ServerMetadata(
        self, request: oip.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerMetadataResponse:
        return oip.ServerMetadataResponse(name=SERVER_NAME, version=server_version())

    async def ModelReady(
        self, request: oip.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelReadyResponse:
        routing = self._routing(request.name, request.version, "name", context)
        return await self._forward("ModelReady", request, routing, context)

    async def ModelMetadata(
        self, request: oip.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelMetadataResponse:
        routing = self._routing(request.name, request.version, "name", context)
        return await self._forward("ModelMetadata", request, routing, context)

    async def ModelInfer(
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        routing = self._routing(request.model_name, request.model_version, "model_name", context)
        if not request.inputs:
            raise InvalidArgument("inputs: empty; send at least one input tensor")
        if PRIORITY_PARAMETER in request.parameters:
            # A model server's queue level: the mesh's to give (the model's batching
            # spec), or an edge caller could put its calls ahead of every other caller's.
            raise InvalidArgument(
                f"parameters['{PRIORITY_PARAMETER}']: not taken at the edge; the model's "
                "batching spec sets its queue level"
            )
        route = ROUTE_PINNED if request.model_version else ROUTE_ROUTED
        started = time.perf_counter()
        try:
            answer: oip.ModelInferResponse = await self._forward(
                "ModelInfer", request, routing, context
            )
        except MeshError as exc:
            routed = exc.routed_version if isinstance(exc, ForwardFailed) else ""
            version = routed or request.model_version
            self._record(request.model_name, version, exc.code.name, started, route)
            raise
        self._record(request.model_name, answer.model_version, "OK", started, route)
        return answer

    def _record(self, model: str, version: str, code: str, started: float, route: str) -> None:
        seconds = time.perf_counter() - started
        self.gateway.metrics.record_oip_infer(model, version, code, seconds, route)

    # --- how each model call goes on -------------------------------------------------------

    def _routing(
        self, model: str, pinned: str, field: str, context: grpc.aio.ServicerContext
    ) -> list[tuple[str, str]]:
        """The headers Envoy routes a model call by; the model must be one the mesh serves,
        and a pinned version one the caller may pin."""
        spec = self.gateway.spec
        if not model:
            raise InvalidArgument(f"{field}: empty; name a model (served: {sorted(spec.models)})")
        if model not in spec.models:
            raise NotFound(f"{field}: no model {model!r} is served (served: {sorted(spec.models)})")
        if pinned and pinned not in spec.models[model].versions:
            versions = sorted(spec.models[model].versions)
            raise NotFound(f"version: {model} has no version {pinned!r} (versions: {versions})")
        check_pin(spec, model, pinned, lambda: caller_of(spec, context))
        routing = [(MODEL_HEADER, model)]
        if pinned:
            routing.append((VERSION_HEADER, pinned))
        return routing

    async def _forward(
        self,
        method: str,
        request: Message,
        routing: list[tuple[str, str]],
        context: grpc.aio.ServicerContext,
    ) -> Any:
        """The same OIP call (`method`, e.g. "ModelInfer") through the mesh within the
        caller's deadline, its status passed back as the model server (or Envoy) gave it."""
        call = getattr(self.gateway.models, method)
        budget = self.gateway.budget
        deadline = budget.absolute_deadline(context)
        incoming = context.invocation_metadata() or ()
        metadata = downstream_metadata(request_id_from(incoming), incoming) + routing
        try:
            return await traced_call(
                method_path(OIP_SERVICE, method),
                lambda sent: call(request, timeout=budget.remaining(deadline), metadata=sent),
                metadata,
            )
        except grpc.aio.AioRpcError as exc:
            failed = ForwardFailed(exc)
            self.gateway.retry_elsewhere(failed.path_lost, context)  # as for Predict
            raise failed from None
