"""Gateway: the public Predict API; features from the feature service, scores from the model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import grpc
import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link

from servemesh.contract.wire import (
    BUCKET_HEADER,
    BUCKET_RANGE_HEADER,
    FEATURE_SERVICE,
    MODEL_HEADER,
    MODEL_INFER_METHOD,
    OIP_SERVICE,
    REPLICA_PARAMETER,
    REQUEST_ID_HEADER,
    RETRY_ELSEWHERE_HEADER,
    ROUTE_PINNED,
    ROUTE_ROUTED,
    SHADOW_ROLE_HEADER,
    SHADOW_ROLE_PRIMARY,
    TRACE_HEADERS,
    VERSION_HEADER,
    ZONE_PARAMETER,
    bucket_ranges,
    lost_the_mesh_listener,
    method_path,
)
from servemesh.contract.wire import (
    Span as SpanAttr,
)
from servemesh.predlog import PredictionLog
from servemesh.predlog.record import PredictWatch
from servemesh.services.feature.wire import build_request, read_matrix
from servemesh.services.gateway.callers import caller_of, check_pin
from servemesh.services.gateway.coalesce import Coalescer, Member, fail, settle
from servemesh.services.gateway.metrics import PredictMetrics, observed
from servemesh.services.gateway.predict import (
    ModelSignature,
    PredictPlan,
    ViewRead,
    conform_inputs,
    fallback_response,
    plan_predict,
    scores_of,
    shared_infer_request,
    signature_from_metadata,
    split_outputs,
    stale_reason,
    view_inputs,
    wire_inputs,
)
from servemesh.services.gateway.tiering import Fresh, TierCall, TierKey, Tiers
from servemesh.services.gateway.tiers import TierState
from servemesh.services.runtime import DeadlineBudget, bind_request_id, request_id_from
from servemesh.services.runtime.errors import Internal, MeshError
from servemesh.services.runtime.logs import new_request_id
from servemesh.services.runtime.tracing import traced_call, tracer
from servemesh.spec import MeshSpec, ModelSpec
from servemesh.spec.policy import CircuitBreakers
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

log = logging.getLogger(__name__)

K = TypeVar("K")
M = TypeVar("M")

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


# Failures of a shared call that may be one member's fault (an entity the view refuses, a
# row the model refuses): its members are asked again one by one, so only that one fails.
MEMBER_FAULT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}


@dataclass(frozen=True)
class FeatureAsk:
    """One Predict's read of one view, as it joins a shared GetFeatures."""

    read: ViewRead
    metadata: list[tuple[str, str]]  # its own request id and trace headers
    span: trace.SpanContext  # its server span's


# A shared GetFeatures: the view, the features read and the tier state asked for (the same
# for every member).
FeatureKey = tuple[str, tuple[str, ...], TierKey | None]
# One view read: its matrix, why stale rows degrade the answer (""), the rows' freshness,
# and the tier state read with it (None: not asked, or the store could not say).
ViewAnswer = tuple[np.ndarray, str, Fresh, TierState | None]


class Features(NamedTuple):
    """One Predict's feature read: each view's matrix, why stale rows degrade the answer
    (""), each view's freshness, and the tier state read with it (None: none)."""

    matrices: dict[str, np.ndarray]
    stale: str
    fresh: dict[str, Fresh]
    tier: TierState | None


# A shared ModelInfer: the model, its spec entry (by identity: a spec change starts new
# calls), where Envoy sends it (a pinned version, or a version's bucket range; None when
# the weighted split picks per call, which is never shared), and the per-row shape of
# every input (rows of one shape concatenate).
ModelKey = tuple[str, int, tuple[str, int, int] | None, tuple[tuple[int, ...], ...]]
PINNED = -1  # the range of a pinned call's key: Envoy routes it by version alone


@dataclass(frozen=True)
class ModelAsk:
    """One Predict's rows, as they join a shared ModelInfer."""

    plan: PredictPlan
    signature: ModelSignature
    inputs: Mapping[str, np.ndarray]  # every model input in wire layout
    metadata: list[tuple[str, str]]  # its own request id and trace headers
    span: trace.SpanContext  # its server span's


class DownstreamError(MeshError):
    """A call to the next hop failed; the caller gets that hop's status, named.
    `routed_version`: the model version Envoy routed the call to, when it says ("")."""

    def __init__(self, hop: str, error: grpc.aio.AioRpcError, routed_version: str = "") -> None:
        super().__init__(f"{hop}: {error.details()}", code=error.code())
        self.hop = hop
        self.routed_version = routed_version
        # The zone's mesh listener refused or dropped the call: this gateway's way
        # downstream failed, not the hop it called.
        self.path_lost = lost_the_mesh_listener(error.code().name, error.details() or "")


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
        # Concurrent Predicts share calls (services/gateway/coalesce.py): one GetFeatures
        # per view and one ModelInfer per model and routing arm.
        self.feature_calls: Coalescer[FeatureKey, FeatureAsk, ViewAnswer] = Coalescer(
            self._send_features, on_call=self._counted("features")
        )
        self.model_calls: Coalescer[ModelKey, ModelAsk, gateway_pb2.PredictResponse] = Coalescer(
            self._send_infer, on_call=self._counted("model")
        )
        self.metrics.watch_waiting("features", self.feature_calls.waiting)
        self.metrics.watch_waiting("model", self.model_calls.waiting)
        # The spec file this gateway follows (set once it follows one) and its stamp when
        # last taken: a file changed since is a change Envoy serves already (it is written
        # once Envoy confirmed) and this gateway not yet, so calls go alone meanwhile.
        self.spec_file: Callable[[], Path | None] = lambda: None
        self._spec_stamp: tuple[int, int, int] | None = None
        # Models Envoy was seen mirroring while their spec entry (kept here) named no shadow.
        self._shadowed: dict[str, ModelSpec] = {}
        # Each model's sticky bucket ranges, for the spec entry they were made from.
        self._ranges: dict[str, tuple[ModelSpec, dict[str, tuple[int, int]]]] = {}
        # The precomputed and cache tiers and the change feed (services/gateway/tiering.py).
        self.tiers = Tiers(spec, self.metrics, self._routed_version)

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
        self._spec_stamp = _file_stamp(self.spec_file())
        self.tiers.follow_spec(spec)

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
            # A version the split gives 0% is pinned by operators only (callers.py).
            check_pin(
                self.spec, plan.model_name, plan.version, lambda: caller_of(self.spec, context)
            )
            metadata = downstream_metadata(request_id, incoming)
            span.set_attribute(SpanAttr.MODEL, plan.model_name)
            signature = await self._signature(plan, deadline, metadata)
            raw = conform_inputs(plan, signature)
            shared = self.spec.coalescing.enabled
            tier = self.tiers.begin(plan)  # may answer on the change feed's word
            if tier.answer is not None:
                return self._answered(watch, tier.answer, request_id, span)
            read = await self._read(watch, tier, deadline, metadata, shared=shared)
            found = self.tiers.before_online(tier, signature, read.tier, read.fresh, read.stale)
            if found is not None:
                return self._answered(watch, found, request_id, span)
            inputs = wire_inputs(signature, view_inputs(plan, read.matrices), raw)
            watch.model_inputs(signature.inputs, inputs)
            ask = ModelAsk(plan, signature, inputs, metadata, span.get_span_context())
            answer = await watch.inference(self._infer(ask, deadline, shared=shared))
            self.tiers.after_online(tier, answer, read.stale)
        except DownstreamError as exc:
            fallback = self._degraded(exc, plan, request_id, context)
            if fallback is None:
                watch.failed(exc)
                raise
            return watch.answered(fallback)
        except BaseException as exc:
            watch.failed(exc)
            raise
        self._online_answered(plan, answer, read.stale, started)
        return self._answered(watch, answer, request_id, span)

    # --- the steps of Predict ------------------------------------------------------------

    async def _read(
        self,
        watch: PredictWatch,
        tier: TierCall,
        deadline: float,
        metadata: list[tuple[str, str]],
        *,
        shared: bool,
    ) -> Features:
        """The call's features, with its version's tier state when it is tiered: one call
        to the feature service whichever tier answers (services/gateway/tiering.py)."""
        try:
            return await watch.features(
                self._features(tier.plan, deadline, metadata, tier.key, shared=shared)
            )
        except DownstreamError:
            self.tiers.read_failed(tier)
            raise

    def _degraded(
        self,
        exc: DownstreamError,
        plan: PredictPlan | None,
        request_id: str,
        context: grpc.aio.ServicerContext,
    ) -> gateway_pb2.PredictResponse | None:
        """What a downstream failure ends as: the model's fallback answer, when it has one
        for this failure; None: the caller gets the error (retried elsewhere or not)."""
        if self.retry_elsewhere(exc.path_lost, context):
            return None
        if plan is None or exc.code not in FALLBACK_CODES:
            return None
        fallback = fallback_response(plan, request_id, str(exc))
        if fallback is not None:
            log.warning("predict degraded", extra={"hop": exc.hop, "code": exc.code.name})
        return fallback

    def retry_elsewhere(self, path_lost: bool, context: grpc.aio.ServicerContext) -> bool:
        """With an Envoy per zone, this zone's is down while the others may not be: when a
        call's way downstream was lost (`path_lost`), the edge tries it again on another
        zone's gateway (its retry policy matches the header), rather than this gateway
        answering a fallback or the failure. True when the edge was asked to."""
        if not (path_lost and self.spec.proxy.layout == "per_zone"):
            return False
        context.set_trailing_metadata(((RETRY_ELSEWHERE_HEADER, "true"),))
        return True

    def _online_answered(
        self, plan: PredictPlan, answer: gateway_pb2.PredictResponse, stale: str, started: float
    ) -> None:
        """The model's answer logged (with request logs on), and marked degraded when it was
        made from features older than their view allows."""
        # A line per answer costs more than the call's whole server path: written only
        # with request logs on (`logs.requests` in the spec, or --request-logs).
        if log.isEnabledFor(logging.INFO):
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
        if stale:
            answer.degraded = True
            answer.degraded_reason = stale

    def _answered(
        self,
        watch: PredictWatch,
        answer: gateway_pb2.PredictResponse,
        request_id: str,
        span: trace.Span,
    ) -> gateway_pb2.PredictResponse:
        answer.request_id = request_id
        span.set_attribute(SpanAttr.VERSION, answer.model_version)
        return watch.answered(answer)

    def _routed_version(self, plan: PredictPlan) -> str | None:
        """The version the call would be routed to per the spec this gateway follows; None
        when unknown (the weighted split picks, or the spec file changed and is not yet
        followed: Envoy may route by the new one already)."""
        arm = self._arm(plan)
        if arm is None or self._spec_in_flux():
            return None
        return arm[0]

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
        self,
        plan: PredictPlan,
        deadline: float,
        metadata: list[tuple[str, str]],
        tier: TierKey | None,
        *,
        shared: bool,
    ) -> Features:
        """Each view's feature matrix (one GetFeatures per view, all at once), why the
        answer is degraded by stale features ("" when it is not), each view's freshness,
        and the `tier` state asked for with the first view's read (a tiered call has one).
        `shared`: each view's read joins those of the concurrent Predicts that read it (and
        ask for the same tier state); else it is made alone, by the same code."""
        if not plan.reads:
            return Features({}, "", {}, None)
        breakers = self.spec.traffic.feature.circuit_breakers
        shared = shared and not _breaker_counts_calls(breakers, self.spec.coalescing.max_rows)
        span = trace.get_current_span().get_span_context()
        limits = self.spec.limits
        max_rows = min(self.spec.coalescing.max_rows, limits.max_rows_per_predict)
        leave_by = deadline - self.budget.hop_budget_s
        asks: list[Awaitable[ViewAnswer]] = []
        for i, read in enumerate(plan.reads):
            key = (read.view, tuple(read.features), tier if i == 0 else None)
            ask = FeatureAsk(read, metadata, span)
            rows = len(read.entity_ids)
            if shared:
                cap = min(max_rows, limits.max_feature_cells // max(1, len(read.features)))
                asks.append(self.feature_calls.submit(key, ask, rows, leave_by, cap))
            else:
                asks.append(self.feature_calls.alone(key, ask, rows, leave_by))
        answers = [await asks[0]] if len(asks) == 1 else await asyncio.gather(*asks)
        return _features_of(plan, answers)

    # --- shared calls (coalescing) -----------------------------------------------------

    def _counted(self, call: str) -> Callable[[object, int], None]:
        def count(_key: object, members: int) -> None:
            self.metrics.record_coalesced(call, members)

        return count

    async def _send_features(
        self, key: FeatureKey, members: list[Member[FeatureAsk, ViewAnswer]]
    ) -> None:
        """One GetFeatures for every member: the union of their entity ids (an entity asked
        twice is read once), each member answered its own rows and stale entities."""
        view, features, tier = key
        if len(members) == 1:
            ids = members[0].item.read.entity_ids
        else:
            ids = list(dict.fromkeys(e for m in members for e in m.item.read.entity_ids))
        lookup = build_request(view, ids, features, tier)
        deadline = min(m.deadline for m in members) + self.budget.hop_budget_s
        try:
            with _current(_shared_span(GET_FEATURES_METHOD, members)):
                reply = await traced_call(
                    GET_FEATURES_METHOD,
                    lambda sent: self.features.GetFeatures(
                        lookup, timeout=self.budget.remaining(deadline), metadata=sent
                    ),
                    _shared_metadata(members),
                )
            matrix = _matrix_of(reply, view, len(ids), len(features))
        except grpc.aio.AioRpcError as exc:
            retry = _retry_after(members, exc)
            for member in members:
                if member not in retry:
                    fail(member, DownstreamError("feature service", exc))
            await self._send_each_or_all(self._send_features, key, retry, exc)
            return
        except MeshError as exc:
            for member in members:
                fail(member, exc)
            return
        if len(members) == 1:
            settle(
                members[0],
                (
                    matrix,
                    stale_reason(ids, reply.vectors),
                    _fresh(reply, reply.vectors),
                    _tier_state(reply, tier, None),
                ),
            )
            return
        position = {entity: i for i, entity in enumerate(ids)}
        for member in members:
            own = member.item.read.entity_ids
            rows = [position[entity] for entity in own]
            vectors = [reply.vectors[i] for i in rows]
            settle(
                member,
                (
                    matrix[rows],
                    stale_reason(own, vectors),
                    _fresh(reply, vectors),
                    _tier_state(reply, tier, rows),
                ),
            )

    async def _send_each_or_all(
        self,
        send: Callable[[K, list[M]], Awaitable[None]],
        key: K,
        members: list[M],
        exc: grpc.aio.AioRpcError,
    ) -> None:
        """Ask again for `members` after a shared call failed with `exc`: one by one when the
        failure may be one member's fault, else together."""
        if not members:
            return
        if exc.code() in MEMBER_FAULT_CODES:
            await asyncio.gather(*(send(key, [member]) for member in members))
        else:
            await send(key, members)

    def _arm(self, plan: PredictPlan) -> tuple[str, int, int] | None:
        """Where Envoy sends the call: its pinned version, or the version whose bucket range
        holds its sticky bucket (per the spec this gateway follows); None when the weighted
        split picks per call (no entity), which no other call may share."""
        if plan.version:
            return (plan.version, PINNED, PINNED)
        bucket = plan.bucket
        if bucket is None:
            return None
        cached = self._ranges.get(plan.model_name)
        if cached is None or cached[0] is not plan.model:
            cached = self._ranges[plan.model_name] = (plan.model, bucket_ranges(plan.model.traffic))
        for version, (start, end) in cached[1].items():
            if start <= bucket < end:
                return (version, start, end)
        return None

    async def _infer(
        self, ask: ModelAsk, deadline: float, *, shared: bool
    ) -> gateway_pb2.PredictResponse:
        """The model's answer to one Predict's rows. `shared`: the rows join those of the
        concurrent Predicts Envoy would send to the same version, where that is safe; else
        the call is made alone, by the same code."""
        plan = ask.plan
        arm = self._arm(plan)
        key: ModelKey = (
            plan.model_name,
            id(plan.model),
            arm,
            tuple(array.shape[1:] for array in ask.inputs.values()),
        )
        leave_by = deadline - self.budget.hop_budget_s
        policy = plan.model.policy or self.spec.traffic.model
        if (
            not shared
            or arm is None
            or self._spec_in_flux()
            or plan.model.shadow is not None
            or self._shadowed.get(plan.model_name) is plan.model
            or _breaker_counts_calls(policy.circuit_breakers, self.spec.coalescing.max_rows)
        ):
            # Alone: the weighted split picks a version per call; a shadowed model's replicas
            # record each call under its request id, which the shadow report pairs; and a
            # breaker sized below a shared call's rows was sized in Predicts.
            return await self.model_calls.alone(key, ask, plan.n_rows, leave_by)
        max_rows = min(self.spec.coalescing.max_rows, plan.model.batching.max_rows_per_request)
        return await self.model_calls.submit(key, ask, plan.n_rows, leave_by, max_rows)

    def _spec_in_flux(self) -> bool:
        """Whether the spec file changed since this gateway last took it."""
        stamp = _file_stamp(self.spec_file())
        if self._spec_stamp is None:
            self._spec_stamp = stamp  # the spec this gateway started with
        return stamp != self._spec_stamp

    async def _send_infer(
        self, key: ModelKey, members: list[Member[ModelAsk, gateway_pb2.PredictResponse]]
    ) -> None:
        """One ModelInfer carrying every member's rows, each member answered its own. The
        members share the key's route (a pinned version or one version's bucket range), so
        the first member's routing headers route them all."""
        first = members[0].item
        model_name = first.plan.model_name
        pinned = bool(first.plan.version)
        route = ROUTE_PINNED if pinned else ROUTE_ROUTED
        metadata = _shared_metadata(members)
        infer = shared_infer_request(
            model_name,
            first.plan.version,
            first.signature,
            [m.item.inputs for m in members],
            dict(metadata)[REQUEST_ID_HEADER],
        )
        routing = self._routing(first.plan)
        deadline = min(m.deadline for m in members) + self.budget.hop_budget_s
        calls: list[grpc.aio.UnaryUnaryCall] = []

        def call(sent: list[tuple[str, str]]) -> grpc.aio.UnaryUnaryCall:
            started = self.models.ModelInfer(
                infer, timeout=self.budget.remaining(deadline), metadata=sent
            )
            calls.append(started)
            return started

        try:
            with _current(_shared_span(MODEL_INFER_METHOD, members)):
                reply = await traced_call(MODEL_INFER_METHOD, call, metadata + routing)
        except grpc.aio.AioRpcError as exc:
            failed = routed_version(exc) or first.plan.version
            retry = _retry_after(members, exc)
            for member in members:
                if member not in retry:
                    self.metrics.record_model_call(model_name, failed, exc.code().name, route)
                    fail(member, DownstreamError("model service", exc, failed))
            await self._send_each_or_all(self._send_infer, key, retry, exc)
            return
        except MeshError as exc:
            for member in members:
                fail(member, exc)
            return
        answered = reply.model_version
        try:
            outputs = split_outputs(reply, [m.item.plan.n_rows for m in members])
        except MeshError as exc:  # an answer of the wrong shape is the version's fault
            for member in members:
                self.metrics.record_model_call(model_name, answered, exc.code.name, route)
                fail(member, exc)
            return
        misrouted: list[Member[ModelAsk, gateway_pb2.PredictResponse]] = []
        if not pinned and len(members) > 1:
            headers = await calls[0].initial_metadata()
            if _shadowed(headers):
                # Envoy mirrors the model's calls before this gateway's spec says so: its
                # replicas record each call under its request id, so each member goes alone
                # (this call's answers unused) until the spec follows.
                self._shadowed[model_name] = first.plan.model
                misrouted = members
            else:
                misrouted = _outside(members, _served_range(headers))
        for member, own in zip(members, outputs, strict=True):
            if member in misrouted:
                continue
            self.metrics.record_model_call(model_name, answered, "OK", route)
            settle(member, _answer(reply, own, member.item.plan.n_rows))
        # Envoy's routes moved before this gateway's spec followed (a weight change under
        # way): the rows of members whose bucket the answering route does not hold were
        # computed by another version than their own; each is asked again, routed alone.
        await asyncio.gather(*(self._send_infer(key, [member]) for member in misrouted))


def _answer(
    reply: oip.ModelInferResponse, outputs: dict[str, gateway_pb2.Tensor], n_rows: int
) -> gateway_pb2.PredictResponse:
    return gateway_pb2.PredictResponse(
        scores=scores_of(outputs, n_rows),
        outputs=outputs,
        model_version=reply.model_version,
        model_replica=_string_parameter(reply, REPLICA_PARAMETER),
        model_zone=_string_parameter(reply, ZONE_PARAMETER),
    )


def _retry_after(members: list[M], exc: grpc.aio.AioRpcError) -> list[M]:
    """The members of a failed shared call that are asked again: all of them when the
    failure may be one member's fault; on DEADLINE_EXCEEDED those with time beyond the
    earliest deadline (the call left with it; they need not share its end); none else."""
    if len(members) < 2:
        return []
    code = exc.code()
    if code in MEMBER_FAULT_CODES:
        return list(members)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        earliest = min(m.deadline for m in members)  # type: ignore[attr-defined]
        return [m for m in members if m.deadline > earliest]  # type: ignore[attr-defined]
    return []


def _file_stamp(path: Path | None) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of a file: an atomic rename changes the inode."""
    if path is None:
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_ino, info.st_size, info.st_mtime_ns)


def _breaker_counts_calls(breakers: CircuitBreakers, max_rows: int) -> bool:
    """Whether a route's circuit breaker is sized below one shared call's rows: Envoy counts
    calls, so an operator who limits a route to a few concurrent calls limits Predicts, and
    sharing calls would let many times more through. Such a route is called per Predict."""
    return min(breakers.max_requests, breakers.max_pending_requests) < max_rows


def _shadowed(metadata: object) -> bool:
    """Whether Envoy mirrored the call (the route marks the primary's answer)."""
    return any(
        key == SHADOW_ROLE_HEADER and value == SHADOW_ROLE_PRIMARY
        for key, value in metadata or ()  # type: ignore[attr-defined]
    )


def _served_range(metadata: object) -> tuple[int, int] | None:
    """The bucket range of the route that answered (BUCKET_RANGE_HEADER), if it says."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == BUCKET_RANGE_HEADER:
            start, _, end = str(value).partition("-")
            try:
                return int(start), int(end)
            except ValueError:
                return None
    return None


def _outside(
    members: list[Member[ModelAsk, gateway_pb2.PredictResponse]], served: tuple[int, int] | None
) -> list[Member[ModelAsk, gateway_pb2.PredictResponse]]:
    """The members whose bucket the answering route does not hold; without its range, all
    but the first (whose bucket routed the call)."""
    if served is None:
        return members[1:]
    start, end = served
    buckets = [m.item.plan.bucket for m in members]
    return [m for m, b in zip(members, buckets, strict=True) if b is None or not start <= b < end]


@contextlib.contextmanager
def _current(span: trace.Span | None) -> Iterator[None]:
    """`span` current (and ended) around the block; nothing without one."""
    if span is None:
        yield
        return
    with trace.use_span(span, end_on_exit=True):
        yield


def _features_of(plan: PredictPlan, read: Sequence[ViewAnswer]) -> Features:
    matrices = {r.view: answer[0] for r, answer in zip(plan.reads, read, strict=True)}
    reasons = [answer[1] for answer in read if answer[1]]
    fresh = {r.view: answer[2] for r, answer in zip(plan.reads, read, strict=True)}
    return Features(matrices, "; ".join(reasons), fresh, read[0][3])


def _tier_state(
    reply: feature_pb2.GetFeaturesResponse, tier: TierKey | None, rows: Sequence[int] | None
) -> TierState | None:
    """The tier state a read brought for the member whose entities are `rows` of the call's
    (None: all of them); None when none was asked for or the store could not say."""
    if tier is None or not reply.HasField("tier"):
        return None
    found = reply.tier
    # No answers at all: the version has no batch run (a miss); else one per entity.
    answers: Sequence[bytes] = found.answers
    if answers and len(answers) != len(reply.vectors):
        return None  # not one answer per entity: not ours to guess at
    if rows is not None and answers:
        answers = [answers[i] for i in rows]
    return TierState(found.flush_generation, found.scored_at_unix_ms, answers)


def _fresh(
    reply: feature_pb2.GetFeaturesResponse, vectors: Sequence[feature_pb2.FeatureVector]
) -> Fresh:
    return reply.view_version, [v.event_time_unix_ms for v in vectors]


def _matrix_of(
    reply: feature_pb2.GetFeaturesResponse, view: str, rows: int, features: int
) -> np.ndarray:
    if len(reply.vectors) != rows:
        raise Internal(f"feature service answered a matrix of the wrong shape for {view}")
    try:
        return read_matrix(reply, features)
    except ValueError:
        raise Internal(f"feature service answered a matrix of the wrong shape for {view}") from None


def _shared_metadata(
    members: Sequence[Member[Any, Any]],
) -> list[tuple[str, str]]:
    """The metadata of a shared call: a lone member's own; several members' call gets an id
    of its own (each member's is on its span's link) and the first member's trace headers,
    whose sampling decision the call keeps when nobody's trace records it."""
    first = members[0].item.metadata
    if len(members) == 1:
        return first
    return [(REQUEST_ID_HEADER, new_request_id()), *(kv for kv in first if kv[0] in TRACE_HEADERS)]


def _shared_span(name: str, members: Sequence[Member[Any, Any]]) -> trace.Span | None:
    """The span of a call several members share, when one of their traces records: a trace
    of its own, linked to every member's server span (as the model server's batch span)."""
    if len(members) == 1:
        return None  # a lone member's call is its own: traced_call makes its client span
    contexts = [m.item.span for m in members]
    if not any(ctx.trace_flags.sampled for ctx in contexts):
        return None
    return tracer().start_span(
        name,
        context=Context(),
        links=[Link(ctx) for ctx in contexts if ctx.is_valid],
        attributes={
            SpanAttr.BATCH_REQUESTS: len(members),
            SpanAttr.REQUEST_ID: ",".join(
                str(dict(m.item.metadata).get(REQUEST_ID_HEADER, "")) for m in members
            ),
        },
    )


def _string_parameter(reply: oip.ModelInferResponse, name: str) -> str:
    param = reply.parameters.get(name)
    return param.string_param if param is not None else ""


def downstream_metadata(request_id: str, incoming: Sequence[Any]) -> list[tuple[str, str]]:
    """The request id follows the request to every hop, and so does the caller's trace
    context: as it came, or (a recorded call) each downstream call's own client span
    (traced_call)."""
    metadata = [(REQUEST_ID_HEADER, request_id)]
    metadata += [(k, v) for k, v in incoming if k in TRACE_HEADERS]
    return metadata
