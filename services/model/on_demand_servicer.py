"""The servicer of an on-demand pool's server: a call first has its version loaded and held.

The same GRPCInferenceService as `servicer.InferenceServicer`, with its repository on
demand (`repository`, `on_demand`): ModelInfer and ModelMetadata (the gateway asks it on a
model's first call) wait for their version's load within their own deadline, and hold the
version until they are answered, so it is never evicted under a call. The rest (admission,
validation, batching, answers) is the plain servicer's, unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import grpc

from servemesh.contract.wire import LOAD_WAIT_PARAMETER
from servemesh.services.model.errors import Overloaded
from servemesh.services.model.inference import request_deadline, routing_headers
from servemesh.services.model.loader import ModelLoader
from servemesh.services.model.on_demand import OnDemand
from servemesh.services.model.repository import Key, ModelRepository
from servemesh.services.model.service import InferenceServicer
from servemesh_api.inference import grpc_service_pb2 as oip

# ModelMetadata's wait for a load when the caller sent no deadline (a tool's call).
METADATA_LOAD_TIMEOUT_S = 60.0


class OnDemandServicer(InferenceServicer):
    """An InferenceServicer whose versions load on their first call (module docstring)."""

    def __init__(
        self,
        *,
        on_demand: OnDemand,
        loader: ModelLoader | None = None,
        expected: Iterable[Key] = (),
        **kwargs: object,
    ) -> None:
        super().__init__(loader=loader, expected=expected, **kwargs)  # type: ignore[arg-type]
        # `expected` names what a call may load here, not what must load before ready.
        self.repository = ModelRepository(loader=loader, expected=expected, on_demand=on_demand)
        self.readiness = self.repository.is_ready

    async def ModelInfer(
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        if self.in_flight >= self.max_in_flight:  # a call waiting for a load counts too
            raise Overloaded(
                f"replica {self.replica} is at its limit of {self.max_in_flight} "
                "concurrent ModelInfer calls"
            )
        _, routed_version, _ = routing_headers(context.invocation_metadata())
        deadline = request_deadline(request, context, self.budget)
        self.in_flight += 1
        try:
            loaded, waited = await self.repository.acquire(
                request.model_name, request.model_version or routed_version, deadline
            )
        finally:
            self.in_flight -= 1
        # Held from here until answered; the plain servicer resolves the same version (a
        # held version stays loaded, and nothing yields between here and its lookup).
        try:
            response = await super().ModelInfer(request, context)
        finally:
            self.repository.release(loaded)
        if waited:
            response.parameters[LOAD_WAIT_PARAMETER].double_param = round(waited * 1000, 3)
        return response

    async def ModelMetadata(
        self, request: oip.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelMetadataResponse:
        remaining = context.time_remaining()
        wait = remaining if remaining is not None else METADATA_LOAD_TIMEOUT_S
        loaded, _ = await self.repository.acquire(
            request.name, request.version, time.monotonic() + wait
        )
        try:
            return await super().ModelMetadata(request, context)
        finally:
            self.repository.release(loaded)
