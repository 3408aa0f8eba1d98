"""OIP inference: a ModelInfer request read (version, deadline, priority, tensors), queued on
its model's batcher and answered; and ModelMetadata, what a model takes and gives.

Every refusal is raised (services/model/errors.py); the runtime's interceptor answers it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping

import grpc
import numpy as np

from servemesh.contract.wire import (
    REPLICA_PARAMETER,
    REQUEST_ID_HEADER,
    SHADOW_ROLE_HEADER,
    VERSION_HEADER,
    ZONE_PARAMETER,
)
from servemesh.services.model.batching.rows import Rows
from servemesh.services.model.errors import RequestError
from servemesh.services.model.loader import LoadedModel
from servemesh.services.model.repository import ModelRepository
from servemesh.services.model.tensors import TensorSig, decode_request, encode_outputs
from servemesh.services.runtime import DeadlineBudget
from servemesh.services.runtime.logs import new_request_id
from servemesh.spec import BatchingSpec
from servemesh_api.inference import grpc_service_pb2 as oip

Metadata = Iterable[tuple[str, str | bytes]]


def routing_headers(metadata: Metadata | None) -> tuple[str, str, str]:
    """(request id, version Envoy routed to, shadow role) from the call's headers, in one
    pass.

    The request id is cut to 128 characters; a fresh one when the caller sent none. The
    shadow role is Envoy's mark on a shadowed call (`shadow.ROLES`), "" on any other.
    """
    request_id = routed_version = role = ""
    for key, value in metadata or ():
        if key == REQUEST_ID_HEADER:
            request_id = (value.decode() if isinstance(value, bytes) else value)[:128]
        elif key == VERSION_HEADER:
            routed_version = value.decode() if isinstance(value, bytes) else value
        elif key == SHADOW_ROLE_HEADER:
            role = value.decode() if isinstance(value, bytes) else value
    return request_id or new_request_id(), routed_version, role


def int_parameter(params: Mapping[str, oip.InferParameter], name: str) -> int | None:
    """An integer request parameter (int64 or uint64), or None when absent."""
    param = params.get(name)
    if param is None:
        return None
    choice = param.WhichOneof("parameter_choice")
    if choice not in ("int64_param", "uint64_param"):
        raise RequestError(
            f"parameters[{name!r}]: expected an int64_param, got {choice or 'nothing'}"
        )
    return int(getattr(param, choice))


def priority_level(request: oip.ModelInferRequest, batching: BatchingSpec) -> int:
    """The queue level of a request: OIP/Triton's `priority` parameter, 1 the most urgent,
    0 or absent the model's default level."""
    wanted = int_parameter(request.parameters, "priority") if request.parameters else None
    if not wanted:
        return batching.default_priority_level
    if not 1 <= wanted <= batching.priority_levels:
        raise RequestError(
            f"parameters['priority']: {wanted} is outside 1..{batching.priority_levels} "
            f"(0 means the default level, {batching.default_priority_level})"
        )
    return wanted


def request_deadline(
    request: oip.ModelInferRequest, context: grpc.aio.ServicerContext, budget: DeadlineBudget
) -> float:
    """The earlier of the gRPC deadline and OIP's `timeout` parameter, less our hop budget
    (on the monotonic clock, the batcher's)."""
    deadline = budget.absolute_deadline(context)
    timeout_us = int_parameter(request.parameters, "timeout") if request.parameters else None
    if timeout_us is not None:
        if timeout_us < 0:
            raise RequestError(f"parameters['timeout']: must not be negative, got {timeout_us}")
        if timeout_us > 0:  # 0 means "no timeout" in OIP
            deadline = min(deadline, time.monotonic() + timeout_us / 1e6)
    # Keep time to serialise and send the answer.
    return deadline - budget.hop_budget_s


async def infer(
    repository: ModelRepository,
    request: oip.ModelInferRequest,
    context: grpc.aio.ServicerContext,
    *,
    request_id: str,
    routed_version: str,
    replica: str,
    zone: str,
    budget: DeadlineBudget,
    caller: str = "",
) -> oip.ModelInferResponse:
    """Validate the request fully, queue it on its version's batcher, answer its rows.

    The version is the request's own, else the one Envoy routed to, else the highest.
    `caller` is who sent it (the call's gRPC peer), for the in-flight journal.
    """
    loaded = repository.resolve(request.model_name, request.model_version or routed_version)
    deadline = request_deadline(request, context, budget)
    priority = priority_level(request, loaded.batching)
    decoded = decode_request(request, loaded.signature, loaded.batching.max_rows_per_request)
    result = await loaded.batcher.submit(decoded.rows, deadline, request_id, priority, caller)
    plain = _plain_answer(loaded, result, decoded.raw, replica, zone)
    if plain is not None:
        if request.id:
            plain.id = request.id
        return plain
    response = oip.ModelInferResponse(
        model_name=loaded.model, model_version=loaded.version, id=request.id
    )
    response.parameters[REPLICA_PARAMETER].string_param = replica
    if zone:
        response.parameters[ZONE_PARAMETER].string_param = zone
    encode_outputs(response, result, loaded.signature, decoded.outputs, decoded.raw)
    return response


@functools.lru_cache(maxsize=1024)
def _answer_head(
    model: str, version: str, replica: str, zone: str, output: TensorSig, n_rows: int
) -> bytes:
    """Everything of a one-output raw answer but its id and its bytes, serialised once."""
    head = oip.ModelInferResponse(model_name=model, model_version=version)
    head.parameters[REPLICA_PARAMETER].string_param = replica
    if zone:
        head.parameters[ZONE_PARAMETER].string_param = zone
    head.outputs.add(name=output.name, datatype=output.datatype, shape=[n_rows, *output.dims])
    return head.SerializeToString()


def _plain_answer(
    loaded: LoadedModel, result: Rows, raw: bool, replica: str, zone: str
) -> oip.ModelInferResponse | None:
    """The answer of a one-output model to a raw request, from a cached head: the same
    message encode_outputs builds, at a fifth of its cost. None for any other answer."""
    signature = loaded.signature
    if not raw or len(signature.outputs) != 1 or not isinstance(result, np.ndarray):
        return None
    output = signature.outputs[0]
    if result.ndim < 1 or result.dtype != output.dtype or result.shape[1:] != output.dims:
        return None  # encode_outputs converts or refuses it
    head = _answer_head(loaded.model, loaded.version, replica, zone, output, int(result.shape[0]))
    response = oip.ModelInferResponse.FromString(head)
    response.raw_output_contents.append(result.tobytes())
    return response


def model_metadata(loaded: LoadedModel, versions: list[str]) -> oip.ModelMetadataResponse:
    """ModelMetadata of a loaded version: platform, every version served, tensor signature."""
    response = oip.ModelMetadataResponse(
        name=loaded.model, versions=versions, platform=loaded.platform
    )
    for sig in loaded.signature.inputs:
        response.inputs.add(name=sig.name, datatype=sig.datatype, shape=list(sig.shape))
    for sig in loaded.signature.outputs:
        response.outputs.add(name=sig.name, datatype=sig.datatype, shape=list(sig.shape))
    return response
