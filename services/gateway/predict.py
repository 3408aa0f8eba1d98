"""Pure Predict logic: validate a request against the spec, build the model call, read it back.

Kept free of network code so every rule here is tested without a server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from servemesh.services.runtime.errors import Internal, InvalidArgument, NotFound
from servemesh.spec import MeshSpec, ModelSpec
from servemesh_api.feature.v1 import feature_pb2
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2 as oip

# The demo models' tensor names; a model's signature comes from the registry at load time,
# and the gateway speaks to every model through this one input/output pair.
INPUT_NAME = "features"
OUTPUT_NAME = "score"


@dataclass(frozen=True)
class PredictPlan:
    model_name: str
    model: ModelSpec
    version: str  # empty: the traffic split picks
    entity_ids: list[str]
    rows: np.ndarray  # caller-supplied rows, float32 (n, n_features)


def plan_predict(request: gateway_pb2.PredictRequest, spec: MeshSpec) -> PredictPlan:
    """Validate a PredictRequest; raise InvalidArgument or NotFound naming the first bad field."""
    if not request.model:
        raise InvalidArgument("model: required")
    model = spec.models.get(request.model)
    if model is None:
        raise NotFound(
            f"model: {request.model[:64]!r} is not served; served models: {sorted(spec.models)}",
        )
    if request.version and request.version not in model.versions:
        raise NotFound(
            f"version: model {request.model!r} has no version {request.version[:64]!r}; "
            f"versions: {sorted(model.versions)}",
        )
    n_rows = len(request.entity_ids) + len(request.rows)
    if n_rows == 0:
        raise InvalidArgument("entity_ids, rows: give at least one")
    if n_rows > spec.limits.max_rows_per_predict:
        raise InvalidArgument(
            f"entity_ids, rows: {n_rows} rows, at most {spec.limits.max_rows_per_predict} per call",
        )
    for i, entity_id in enumerate(request.entity_ids):
        if not entity_id or len(entity_id) > 256:
            raise InvalidArgument(f"entity_ids[{i}]: empty or longer than 256")
    width = len(model.features)
    rows = np.empty((len(request.rows), width), dtype=np.float32)
    for i, row in enumerate(request.rows):
        if len(row.values) != width:
            raise InvalidArgument(
                f"rows[{i}].values: model {request.model!r} takes {width} features, "
                f"got {len(row.values)}",
            )
        rows[i] = row.values
    if rows.size and not np.isfinite(rows).all():
        bad_row, bad_col = map(int, np.argwhere(~np.isfinite(rows))[0])
        raise InvalidArgument(
            f"rows[{bad_row}].values[{bad_col}]: not a finite number",
        )
    return PredictPlan(
        model_name=request.model,
        model=model,
        version=request.version,
        entity_ids=list(request.entity_ids),
        rows=rows,
    )


def build_infer_request(
    plan: PredictPlan, features: np.ndarray, request_id: str
) -> oip.ModelInferRequest:
    """An OIP v2 request carrying the feature matrix as one raw FP32 tensor."""
    batch = np.ascontiguousarray(features, dtype="<f4")
    request = oip.ModelInferRequest(
        model_name=plan.model_name, model_version=plan.version, id=request_id
    )
    request.inputs.add(name=INPUT_NAME, datatype="FP32", shape=list(batch.shape))
    request.outputs.add(name=OUTPUT_NAME)
    request.raw_input_contents.append(batch.tobytes())
    return request


def read_scores(response: oip.ModelInferResponse, n_rows: int) -> list[float]:
    """Scores from the model's answer; raises Internal when it is not n_rows floats."""
    for index, output in enumerate(response.outputs):
        if output.name != OUTPUT_NAME:
            continue
        if output.datatype != "FP32":
            break
        if index < len(response.raw_output_contents):
            values = np.frombuffer(response.raw_output_contents[index], dtype="<f4")
        else:
            values = np.asarray(output.contents.fp32_contents, dtype=np.float32)
        if values.size == n_rows:
            return [float(v) for v in values]
        break
    raise Internal("model answered without one FP32 score per row")


def stale_reason(entity_ids: Sequence[str], vectors: Sequence[feature_pb2.FeatureVector]) -> str:
    """Why an answer is degraded by its features: the entities whose stored values are older
    than their view allows (served under the view's `degraded` policy); "" when none are."""
    stale = [entity for entity, vector in zip(entity_ids, vectors, strict=True) if vector.stale]
    if not stale:
        return ""
    shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
    return f"stale features for {shown}"


def fallback_response(
    plan: PredictPlan, request_id: str, reason: str
) -> gateway_pb2.PredictResponse | None:
    """The degraded answer the spec allows for this model, or None when it allows none."""
    score = plan.model.fallback_score
    if score is None or not math.isfinite(score):
        return None
    n_rows = len(plan.entity_ids) + len(plan.rows)
    return gateway_pb2.PredictResponse(
        scores=[score] * n_rows,
        model_version="fallback",
        degraded=True,
        degraded_reason=reason,
        request_id=request_id,
    )
