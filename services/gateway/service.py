"""Gateway: the public Predict API; features from the feature service, scores from the model."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import grpc
import numpy as np
from opentelemetry import trace

from servemesh.predlog import PredictionLog
from servemesh.services.gateway.metrics import PredictMetrics, observed
from servemesh.services.gateway.predict import (
    ModelSignature,
    PredictPlan,
    ViewRead,
    build_infer_request,
    conform_inputs,
    fallback_response,
    plan_predict,
    read_outputs,
    scores_of,
    signature_from_metadata,
    stale_reason,
    view_inputs,
)
from servemesh.services.runtime import DeadlineBudget, bind_request_id, request_id_from
from servemesh.services.runtime.errors import Internal, MeshError
from servemesh.services.runtime.tracing import traced_call
from servemesh.spec import MeshSpec
from servemesh.wire import (
    BUCKET_HEADER,
    FEATURE_SERVICE,
    MODEL_HEADER,
    MODEL_INFER_METHOD,
    OIP_SERVICE,
    REPLICA_PARAMETER,
    REQUEST_ID_HEADER,
    TRACE_HEADERS,
    VERSION_HEADER,
    ZONE_PARAMETER,
    method_path,
)
from servemesh.wire import (
    Span as SpanAttr,
)
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

log = logging.getLogger(__name__)

GET_FEATURES_METHOD = method_path(FEATURE_SERVICE, "GetFeatures")
MODEL_METADATA_METHOD = method_path(OIP_SERVICE, "ModelMetadata")

# Downstream failures a configured fallback may answer for. Not DEADLINE_EXCEEDED: when the
# caller's time is up, a late fallback helps nobody.
FALLBACK_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


class DownstreamError(MeshError):
    """A call to the next hop failed; the caller gets that hop's status, named.
    `routed_version`: the model version Envoy routed the call to, when it says ("")."""

    def __init__(self, hop: str, error: grpc.aio.AioRpcError, routed_version: str = "") -> None:
        super().__init__(f"{hop}: {error.details()}", code=error.code())
        self.hop = hop
        self.routed_version = routed_version


def routed_version(error: grpc.aio.AioRpcError) -> str:
    """The version Envoy routed a failed model call to: every model route names it in a
    response header (trailers-only answers, which failed gRPC calls mostly are, carry it
    with the trailers)."""
    for metadata in (error.trailing_metadata(), error.initial_metadata()):
        for key, value in metadata or ():
            if key == VERSION_HEADER and isinstance(value, str):
                return value
    return ""


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        spec: MeshSpec,
        mesh_channel: grpc.aio.Channel,
        metrics: PredictMetrics | None = None,
        predictions: PredictionLog | None = None,
    ) -> None:
        self.spec = spec
        self.metrics = metrics or PredictMetrics()
        self.predictions = predictions or PredictionLog.disabled()
        self.budget = DeadlineBudget(
            spec.deadlines.hop_budget_ms / 1000, spec.deadlines.default_timeout_ms / 1000
        )
        self.use_channel(mesh_channel)
        # Each model's signature (the datatype and shape of every tensor), learned from a
        # replica through Envoy with OIP ModelMetadata on the model's first call and kept
        # until the model's spec entry changes. Asking the replica rather than the registry
        # keeps the gateway off the registry's path (it is not on the hot path, and an
        # alias may move), and the spec's contract says every version takes the same
        # inputs, so whichever version answers speaks for all.
        self.signatures: dict[str, ModelSignature] = {}

    def use_channel(self, mesh_channel: grpc.aio.Channel) -> None:
        """Send calls from now on over `mesh_channel` (a re-dial after a rotation)."""
        self.features = feature_pb2_grpc.FeatureServiceStub(mesh_channel)
        self.models = grpc_service_pb2_grpc.GRPCInferenceServiceStub(mesh_channel)

    async def follow_spec(self, spec: MeshSpec) -> None:
        """Serve the models of `spec` from the next call on (calls under way keep theirs);
        a model whose entry changed has its signature learned again."""
        for name in list(self.signatures):
            if spec.models.get(name) != self.spec.models.get(name):
                del self.signatures[name]
        self.spec = spec

    @observed
    async def Predict(
        self, request: gateway_pb2.PredictRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.PredictResponse:
        incoming = context.invocation_metadata() or ()
        request_id = request_id_from(incoming)
        bind_request_id(request_id)
        deadline = self.budget.absolute_deadline(context)
        started = time.perf_counter()
        # One record per call, whatever its end: the watch only appends to a bounded buffer.
        watch = self.predictions.watch(request, request_id, incoming)
        span = trace.get_current_span()  # the call's server span: what an SRE searches by
        span.set_attribute(SpanAttr.REQUEST_ID, request_id)
        plan: PredictPlan | None = None
        try:
            plan = plan_predict(request, self.spec)
            # The request id follows the request to every hop, and so does the caller's
            # trace context: as it came, or (a recorded call) each downstream call's own
            # client span (traced_call).
            metadata = [(REQUEST_ID_HEADER, request_id)]
            metadata += [(k, v) for k, v in incoming if k in TRACE_HEADERS]
            span.set_attribute(SpanAttr.MODEL, plan.model_name)
            signature = await self._signature(plan, deadline, metadata)
            raw = conform_inputs(plan, signature)
            matrices, stale = await watch.features(self._features(plan, deadline, metadata))
            answer = await watch.inference(
                self._infer(
                    plan,
                    signature,
                    view_inputs(plan, matrices),
                    raw,
                    deadline,
                    metadata,
                    request_id,
                )
            )
        except DownstreamError as exc:
            fallback = (
                fallback_response(plan, request_id, str(exc))
                if plan and exc.code in FALLBACK_CODES
                else None
            )
            if fallback is not None:
                log.warning("predict degraded", extra={"hop": exc.hop, "code": exc.code.name})
                return watch.answered(fallback)
            watch.failed(exc)
            raise
        except BaseException as exc:
            watch.failed(exc)
            raise
        log.info(
            "predict",
            extra={
                "model": plan.model_name,
                "version": answer.model_version,
                "replica": answer.model_replica,
                "rows": plan.n_rows,
                "ms": round((time.perf_counter() - started) * 1000, 3),
            },
        )
        answer.request_id = request_id
        span.set_attribute(SpanAttr.VERSION, answer.model_version)
        if stale:
            # The model answered from features older than their view allows: say so.
            answer.degraded = True
            answer.degraded_reason = stale
        return watch.answered(answer)

    def _routing(self, plan: PredictPlan) -> list[tuple[str, str]]:
        # Envoy routes on these headers: the model picks the route, a pinned version its cluster.
        routing = [(MODEL_HEADER, plan.model_name)]
        if plan.version:
            routing.append((VERSION_HEADER, plan.version))
        elif plan.bucket is not None:
            # Envoy routes the entity's bucket to a version: the same entity, the same
            # version, while the weights stand.
            routing.append((BUCKET_HEADER, str(plan.bucket)))
        return routing

    async def _signature(
        self, plan: PredictPlan, deadline: float, metadata: list[tuple[str, str]]
    ) -> ModelSignature:
        known = self.signatures.get(plan.model_name)
        if known is not None:
            return known
        try:
            reply = await traced_call(
                MODEL_METADATA_METHOD,
                lambda sent: self.models.ModelMetadata(
                    oip.ModelMetadataRequest(name=plan.model_name, version=plan.version),
                    timeout=self.budget.remaining(deadline),
                    metadata=sent,
                ),
                metadata + self._routing(plan),
            )
        except grpc.aio.AioRpcError as exc:
            raise DownstreamError("model service", exc, routed_version(exc)) from None
        signature = signature_from_metadata(plan.model_name, plan.model, reply)
        # Kept only while the spec that planned this call is still the one served.
        if self.spec.models.get(plan.model_name) == plan.model:
            self.signatures[plan.model_name] = signature
        return signature

    async def _features(
        self, plan: PredictPlan, deadline: float, metadata: list[tuple[str, str]]
    ) -> tuple[dict[str, np.ndarray], str]:
        """Each view's feature matrix (one GetFeatures per view, all at once), and why the
        answer is degraded by stale features ("" when it is not)."""
        if not plan.reads:
            return {}, ""
        read = await asyncio.gather(*(self._read_view(r, deadline, metadata) for r in plan.reads))
        matrices = {r.view: matrix for r, (matrix, _) in zip(plan.reads, read, strict=True)}
        reasons = [reason for _, reason in read if reason]
        return matrices, "; ".join(reasons)

    async def _read_view(
        self, read: ViewRead, deadline: float, metadata: list[tuple[str, str]]
    ) -> tuple[np.ndarray, str]:
        lookup = feature_pb2.GetFeaturesRequest(
            view=read.view, entity_ids=read.entity_ids, feature_names=read.features
        )
        try:
            reply = await traced_call(
                GET_FEATURES_METHOD,
                lambda sent: self.features.GetFeatures(
                    lookup, timeout=self.budget.remaining(deadline), metadata=sent
                ),
                metadata,
            )
        except grpc.aio.AioRpcError as exc:
            raise DownstreamError("feature service", exc) from None
        matrix = np.array([v.values for v in reply.vectors], dtype=np.float32)
        if matrix.shape != (len(read.entity_ids), len(read.features)):
            raise Internal(f"feature service answered a matrix of the wrong shape for {read.view}")
        return matrix, stale_reason(read.entity_ids, reply.vectors)

    async def _infer(
        self,
        plan: PredictPlan,
        signature: ModelSignature,
        views: Mapping[str, np.ndarray],
        raw: Mapping[str, np.ndarray],
        deadline: float,
        metadata: list[tuple[str, str]],
        request_id: str,
    ) -> gateway_pb2.PredictResponse:
        try:
            infer = build_infer_request(plan, signature, views, raw, request_id)
            reply = await traced_call(
                MODEL_INFER_METHOD,
                lambda sent: self.models.ModelInfer(
                    infer, timeout=self.budget.remaining(deadline), metadata=sent
                ),
                metadata + self._routing(plan),
            )
        except grpc.aio.AioRpcError as exc:
            # Counted against the version that failed, even when a fallback answers.
            version = routed_version(exc) or plan.version
            self.metrics.record_model_call(plan.model_name, version, exc.code().name)
            raise DownstreamError("model service", exc, version) from None
        try:
            outputs = read_outputs(reply, plan.n_rows)
        except MeshError as exc:  # an answer of the wrong shape is the version's fault
            self.metrics.record_model_call(plan.model_name, reply.model_version, exc.code.name)
            raise
        self.metrics.record_model_call(plan.model_name, reply.model_version, "OK")
        return gateway_pb2.PredictResponse(
            scores=scores_of(outputs, plan.n_rows),
            outputs=outputs,
            model_version=reply.model_version,
            model_replica=_string_parameter(reply, REPLICA_PARAMETER),
            model_zone=_string_parameter(reply, ZONE_PARAMETER),
        )


def _string_parameter(reply: oip.ModelInferResponse, name: str) -> str:
    param = reply.parameters.get(name)
    return param.string_param if param is not None else ""
