"""Gateway: the public Predict API; features from the feature service, scores from the model."""

from __future__ import annotations

import logging
import time

import grpc
import numpy as np

from servemesh.services.gateway.predict import (
    PredictPlan,
    build_infer_request,
    fallback_response,
    plan_predict,
    read_scores,
    stale_reason,
)
from servemesh.services.runtime import DeadlineBudget, bind_request_id, request_id_from
from servemesh.services.runtime.errors import Internal, MeshError
from servemesh.spec import MeshSpec
from servemesh.wire import (
    MODEL_HEADER,
    REPLICA_PARAMETER,
    REQUEST_ID_HEADER,
    TRACE_HEADERS,
    VERSION_HEADER,
    ZONE_PARAMETER,
)
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

log = logging.getLogger(__name__)

# Downstream failures a configured fallback may answer for. Not DEADLINE_EXCEEDED: when the
# caller's time is up, a late fallback helps nobody.
FALLBACK_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


class DownstreamError(MeshError):
    """A call to the next hop failed; the caller gets that hop's status, named."""

    def __init__(self, hop: str, error: grpc.aio.AioRpcError) -> None:
        super().__init__(f"{hop}: {error.details()}", code=error.code())
        self.hop = hop


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, spec: MeshSpec, mesh_channel: grpc.aio.Channel) -> None:
        self.spec = spec
        self.budget = DeadlineBudget(
            spec.deadlines.hop_budget_ms / 1000, spec.deadlines.default_timeout_ms / 1000
        )
        self.features = feature_pb2_grpc.FeatureServiceStub(mesh_channel)
        self.models = grpc_service_pb2_grpc.GRPCInferenceServiceStub(mesh_channel)

    async def follow_spec(self, spec: MeshSpec) -> None:
        """Serve the models of `spec` from the next call on (calls under way keep theirs)."""
        self.spec = spec

    async def Predict(
        self, request: gateway_pb2.PredictRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.PredictResponse:
        incoming = context.invocation_metadata() or ()
        request_id = request_id_from(incoming)
        bind_request_id(request_id)
        deadline = self.budget.absolute_deadline(context)
        started = time.perf_counter()
        plan: PredictPlan | None = None
        try:
            plan = plan_predict(request, self.spec)
            # The request id and the trace context follow the request to every hop.
            metadata = [(REQUEST_ID_HEADER, request_id)]
            metadata += [(k, v) for k, v in incoming if k in TRACE_HEADERS]
            features, stale = await self._features(plan, deadline, metadata)
            answer = await self._infer(plan, features, deadline, metadata, request_id)
        except DownstreamError as exc:
            fallback = (
                fallback_response(plan, request_id, str(exc))
                if plan and exc.code in FALLBACK_CODES
                else None
            )
            if fallback is not None:
                log.warning("predict degraded", extra={"hop": exc.hop, "code": exc.code.name})
                return fallback
            raise
        log.info(
            "predict",
            extra={
                "model": plan.model_name,
                "version": answer.model_version,
                "replica": answer.model_replica,
                "rows": len(answer.scores),
                "ms": round((time.perf_counter() - started) * 1000, 3),
            },
        )
        answer.request_id = request_id
        if stale:
            # The model answered from features older than their view allows: say so.
            answer.degraded = True
            answer.degraded_reason = stale
        return answer

    async def _features(
        self, plan: PredictPlan, deadline: float, metadata: list[tuple[str, str]]
    ) -> tuple[np.ndarray, str]:
        """Feature matrix (looked-up entities first, then the caller's own rows), and why
        the answer is degraded by stale features ("" when it is not)."""
        if not plan.entity_ids:
            return plan.rows, ""
        lookup = feature_pb2.GetFeaturesRequest(
            view=plan.model.feature_view,
            entity_ids=plan.entity_ids,
            feature_names=plan.model.features,
        )
        try:
            reply = await self.features.GetFeatures(
                lookup, timeout=self.budget.remaining(deadline), metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise DownstreamError("feature service", exc) from None
        looked_up = np.array([v.values for v in reply.vectors], dtype=np.float32)
        if looked_up.shape != (len(plan.entity_ids), len(plan.model.features)):
            raise Internal("feature service answered a matrix of the wrong shape")
        matrix = np.concatenate([looked_up, plan.rows]) if len(plan.rows) else looked_up
        return matrix, stale_reason(plan.entity_ids, reply.vectors)

    async def _infer(
        self,
        plan: PredictPlan,
        features: np.ndarray,
        deadline: float,
        metadata: list[tuple[str, str]],
        request_id: str,
    ) -> gateway_pb2.PredictResponse:
        # Envoy routes on these headers: the model picks the route, a pinned version its cluster.
        routing = [(MODEL_HEADER, plan.model_name)]
        if plan.version:
            routing.append((VERSION_HEADER, plan.version))
        try:
            reply = await self.models.ModelInfer(
                build_infer_request(plan, features, request_id),
                timeout=self.budget.remaining(deadline),
                metadata=metadata + routing,
            )
        except grpc.aio.AioRpcError as exc:
            raise DownstreamError("model service", exc) from None
        return gateway_pb2.PredictResponse(
            scores=read_scores(reply, len(features)),
            model_version=reply.model_version,
            model_replica=_string_parameter(reply, REPLICA_PARAMETER),
            model_zone=_string_parameter(reply, ZONE_PARAMETER),
        )


def _string_parameter(reply: oip.ModelInferResponse, name: str) -> str:
    param = reply.parameters.get(name)
    return param.string_param if param is not None else ""
