"""Pure Predict logic: validate a request against the spec, build the model call, read it back.

Kept free of network code so every rule here is tested without a server. A request is
checked in two steps: `plan_predict` against the spec alone (model, version, entities, the
caller's tensors on their own), then `conform_inputs` against the signature the gateway
learned from the model (datatypes and per-row shapes of the raw inputs).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from servemesh.contract.echo import shown
from servemesh.contract.wire import BUCKETS
from servemesh.services.gateway.metrics import FALLBACK_VERSION
from servemesh.services.gateway.tensors import (
    DATATYPES,
    CallerTensor,
    conform,
    decode_output,
    read_tensor,
    to_public,
    to_wire,
)
from servemesh.services.runtime.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
)
from servemesh.spec import MeshSpec, ModelSpec
from servemesh.spec.model_contract import check_model_contract
from servemesh_api.feature.v1 import feature_pb2
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2 as oip

MAX_ID_LENGTH = 256


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a model's signature, as its ModelMetadata answers it."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelSignature:
    """What a model takes and gives, learned from a replica (OIP ModelMetadata)."""

    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]

    def input_named(self, name: str) -> TensorMeta | None:
        return next((t for t in self.inputs if t.name == name), None)


def signature_from_metadata(
    model_name: str, model: ModelSpec, metadata: oip.ModelMetadataResponse
) -> ModelSignature:
    """The signature a replica answered, checked against the spec's entry for the model;
    FailedPrecondition naming every mismatch (the deployment's fault, not the caller's)."""
    signature = ModelSignature(
        inputs=tuple(TensorMeta(t.name, t.datatype, tuple(t.shape)) for t in metadata.inputs),
        outputs=tuple(TensorMeta(t.name, t.datatype, tuple(t.shape)) for t in metadata.outputs),
    )
    problems = check_model_contract(model_name, model, signature.inputs, signature.outputs)
    if problems:
        raise FailedPrecondition(
            f"model {model_name!r}: the spec and the served model disagree: "
            + "; ".join(problems[:5])
        )
    return signature


@dataclass(frozen=True)
class ViewRead:
    """One GetFeatures call: the ids of `entity` per entity row, the features every input
    filled from `view` needs (their union, in first-named order)."""

    view: str
    entity: str
    entity_ids: list[str]
    features: list[str]


def sticky_bucket(model: str, entity_id: str) -> int:
    """The entity's bucket for `model`, 0..BUCKETS-1: the same on every call and every
    gateway (a keyed hash, not Python's per-process `hash`). The model's name is part of the
    key, so the entities that meet one model's canary are not always the ones that meet
    every other model's."""
    digest = hashlib.blake2b(
        entity_id.encode(), digest_size=8, key=model.encode()[:64], person=b"servemesh-bkt"
    ).digest()
    return int.from_bytes(digest, "big") % BUCKETS


@dataclass(frozen=True)
class PredictPlan:
    model_name: str
    model: ModelSpec
    version: str  # empty: the traffic split picks
    entity_rows: int  # rows whose view inputs come from the feature store
    reads: list[ViewRead]  # one per view the model reads (none without entity rows)
    # The shorthand's caller-supplied rows (float32, n x n_features), after the entity rows.
    rows: np.ndarray
    raw: dict[str, CallerTensor]  # the model's raw inputs, by tensor name

    @cached_property
    def bucket(self) -> int | None:
        """The sticky bucket of the call (its first entity id), which Envoy routes to a
        version while the weights stand; None for a call without entities (the weighted
        split picks) or one that pins its version."""
        if self.version:
            return None
        for read in self.reads:
            if read.entity_ids:
                return sticky_bucket(self.model_name, read.entity_ids[0])
        return None

    @property
    def n_rows(self) -> int:
        if self.reads or self.rows.size or not self.raw:
            return self.entity_rows + len(self.rows)
        return next(iter(self.raw.values())).rows


def plan_predict(request: gateway_pb2.PredictRequest, spec: MeshSpec) -> PredictPlan:
    """Validate a PredictRequest against the spec; raise InvalidArgument or NotFound naming
    the first bad field."""
    if not request.model:
        raise InvalidArgument("model: required")
    model = spec.models.get(request.model)
    # Refusals name what the caller sent, never the catalogue: a caller learns nothing
    # about the models and versions it was not told of.
    if model is None:
        raise NotFound(f"model: {shown(request.model)} is not served")
    if request.version and request.version not in model.versions:
        raise NotFound(f"version: model {request.model!r} has no version {shown(request.version)}")
    if model.inputs is None:
        return _plan_shorthand(request, spec, model)
    return _plan_inputs(request, spec, model)


def _plan_shorthand(
    request: gateway_pb2.PredictRequest, spec: MeshSpec, model: ModelSpec
) -> PredictPlan:
    """One input named `features` from one view: entity_ids (or entities), then rows."""
    if request.inputs:
        name = next(iter(request.inputs))
        raise InvalidArgument(
            f"inputs[{shown(name)}]: model {request.model!r} takes no raw inputs; its "
            f"features come from view {model.feature_view!r} (entity_ids) or rows"
        )
    entity = spec.entity_of(model.feature_view)
    ids = _entity_ids(request, [entity], request.model)
    n_rows = len(ids[entity]) + len(request.rows)
    if n_rows == 0:
        raise InvalidArgument("entity_ids, rows: give at least one")
    if n_rows > spec.limits.max_rows_per_predict:
        raise InvalidArgument(
            f"entity_ids, rows: {n_rows} rows, at most {spec.limits.max_rows_per_predict} per call",
        )
    _check_ids(request, ids)
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
    entity_ids = ids[entity]
    reads = (
        [ViewRead(model.feature_view, entity, entity_ids, list(model.features))]
        if entity_ids
        else []
    )
    return PredictPlan(
        model_name=request.model,
        model=model,
        version=request.version,
        entity_rows=len(entity_ids),
        reads=reads,
        rows=rows,
        raw={},
    )


def _plan_inputs(
    request: gateway_pb2.PredictRequest, spec: MeshSpec, model: ModelSpec
) -> PredictPlan:
    """A model that lists its inputs: entities for its views, raw inputs from the caller."""
    name = request.model
    if request.rows:
        raise InvalidArgument(
            f"rows: model {name!r} lists named inputs; send entities for its feature views "
            "and its raw inputs in inputs"
        )
    entities = spec.entities_of(model)
    ids = _entity_ids(request, entities, name)
    entity_rows = len(next(iter(ids.values()))) if ids else 0
    limit = spec.limits.max_rows_per_predict
    if entities and entity_rows == 0:
        raise InvalidArgument(
            f"entities: model {name!r} reads entities {entities}; give one row of ids per row"
        )
    if entity_rows > limit:
        raise InvalidArgument(f"entities: {entity_rows} rows, at most {limit} per call")
    _check_ids(request, ids)
    raw_names = [n for n, s in model.effective_inputs.items() if s.raw]
    raw: dict[str, CallerTensor] = {}
    for tensor_name in sorted(request.inputs):
        where = f"inputs[{shown(tensor_name)}]"
        input_spec = model.effective_inputs.get(tensor_name)
        if input_spec is None:
            raise InvalidArgument(
                f"{where}: model {name!r} has no input {shown(tensor_name)}; "
                f"its raw inputs: {raw_names}"
            )
        if not input_spec.raw:
            raise InvalidArgument(
                f"{where}: filled from feature view {input_spec.view!r}; name its entity "
                f"{spec.entity_of(input_spec.view or '')!r} in entities instead"
            )
        raw[tensor_name] = read_tensor(request.inputs[tensor_name], where)
    for tensor_name in raw_names:
        if tensor_name not in raw:
            raise InvalidArgument(
                f"inputs[{tensor_name!r}]: required: model {name!r} takes it from the caller"
            )
    first: tuple[str, int] | None = None
    for tensor_name, tensor in raw.items():
        where = f"inputs[{tensor_name!r}].shape[0]"
        if entities and tensor.rows != entity_rows:
            raise InvalidArgument(
                f"{where}: {tensor.rows} rows, but entities names {entity_rows}; "
                "every input carries one row per entity row"
            )
        if first is None:
            first = (tensor_name, tensor.rows)
        elif tensor.rows != first[1]:
            raise InvalidArgument(
                f"{where}: {tensor.rows} rows, but inputs[{first[0]!r}] has {first[1]}; "
                "every input carries the same rows"
            )
        if tensor.rows > limit:
            raise InvalidArgument(f"{where}: {tensor.rows} rows, at most {limit} per call")
    reads = []
    for view in model.views:
        features: list[str] = []
        for input_spec in model.effective_inputs.values():
            if input_spec.view == view:
                features += [f for f in input_spec.features or () if f not in features]
        entity = spec.entity_of(view)
        reads.append(ViewRead(view, entity, ids[entity], features))
    return PredictPlan(
        model_name=name,
        model=model,
        version=request.version,
        entity_rows=entity_rows,
        reads=reads,
        rows=np.empty((0, 0), dtype=np.float32),
        raw=raw,
    )


def _entity_ids(
    request: gateway_pb2.PredictRequest, entities: list[str], model: str
) -> dict[str, list[str]]:
    """The ids per entity the request names, one per row (entity_ids or entities)."""
    if request.entity_ids and request.entities:
        raise InvalidArgument("entities: give entity_ids or entities, not both")
    if request.entity_ids:
        if len(entities) != 1:
            reads = f"reads entities {entities}" if entities else "reads no feature view"
            raise InvalidArgument(
                f"entity_ids: model {model!r} {reads}; "
                + ("name each row's ids in entities" if entities else "send its inputs")
            )
        return {entities[0]: list(request.entity_ids)}
    ids: dict[str, list[str]] = {entity: [] for entity in entities}
    if request.entities and not entities:
        raise InvalidArgument(f"entities: model {model!r} reads no feature view; send its inputs")
    for i, row in enumerate(request.entities):
        unknown = sorted(set(row.ids) - set(entities))
        if unknown:
            raise InvalidArgument(
                f"entities[{i}]: unknown entity {shown(unknown[0])}; model {model!r} reads "
                f"{entities}"
            )
        for entity in entities:
            if entity not in row.ids:
                raise InvalidArgument(f"entities[{i}]: names no id for entity {entity!r}")
            ids[entity].append(row.ids[entity])
    return ids


def _check_ids(request: gateway_pb2.PredictRequest, ids: Mapping[str, list[str]]) -> None:
    for entity, values in ids.items():
        for i, entity_id in enumerate(values):
            if not entity_id or len(entity_id) > MAX_ID_LENGTH:
                where = (
                    f"entity_ids[{i}]" if request.entity_ids else f"entities[{i}].ids[{entity!r}]"
                )
                raise InvalidArgument(f"{where}: empty or longer than {MAX_ID_LENGTH}")


def conform_inputs(plan: PredictPlan, signature: ModelSignature) -> dict[str, np.ndarray]:
    """The raw inputs as the model takes them (datatype, per-row shape), in wire layout;
    InvalidArgument naming the field when one does not fit."""
    conformed = {}
    for name, tensor in plan.raw.items():
        meta = signature.input_named(name)
        if meta is None:  # signature_from_metadata checked every input is mapped
            raise Internal(f"model {plan.model_name!r} has no input {name!r}")
        conformed[name] = conform(
            tensor, meta.datatype, meta.shape, f"inputs[{name!r}]", plan.model_name
        )
    return conformed


def view_inputs(plan: PredictPlan, matrices: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each view-filled input's float32 matrix from the views' matrices (columns in each
    read's `features` order), the shorthand's caller rows after the entity rows."""
    by_view = {read.view: read for read in plan.reads}
    filled: dict[str, np.ndarray] = {}
    for name, spec in plan.model.effective_inputs.items():
        if spec.view is None or spec.features is None:
            continue
        read = by_view.get(spec.view)
        if read is None:  # no entity rows: the shorthand's caller rows alone
            matrix = np.empty((0, len(spec.features)), dtype=np.float32)
        elif spec.features == read.features:
            matrix = matrices[spec.view]  # the input reads the view's columns as asked
        else:
            position = {feature: i for i, feature in enumerate(read.features)}
            matrix = matrices[spec.view][:, [position[f] for f in spec.features]]
        if plan.rows.size:
            matrix = np.concatenate([matrix, plan.rows])
        filled[name] = matrix
    return filled


def build_infer_request(
    plan: PredictPlan,
    signature: ModelSignature,
    views: Mapping[str, np.ndarray],
    raw: Mapping[str, np.ndarray],
    request_id: str,
) -> oip.ModelInferRequest:
    """An OIP v2 request with one raw tensor per model input, in the signature's order and
    datatypes: `views` float32 matrices (converted here), `raw` already conformed. No
    outputs are named, so the model answers all of them."""
    return shared_infer_request(
        plan.model_name,
        plan.version,
        signature,
        [wire_inputs(signature, views, raw)],
        request_id,
    )


def wire_inputs(
    signature: ModelSignature, views: Mapping[str, np.ndarray], raw: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Every model input in the model's wire layout, by name: `views` float32 matrices
    converted to the input's datatype (InvalidArgument naming the input when a value does
    not fit), `raw` already conformed."""
    wire: dict[str, np.ndarray] = {}
    for meta in signature.inputs:
        if meta.name in raw:
            wire[meta.name] = raw[meta.name]
        else:
            wire[meta.name] = to_wire(views[meta.name], meta.datatype, f"inputs[{meta.name!r}]")
    return wire


def shared_infer_request(
    model_name: str,
    version: str,
    signature: ModelSignature,
    members: Sequence[Mapping[str, np.ndarray]],
    request_id: str,
) -> oip.ModelInferRequest:
    """One OIP v2 request carrying the rows of every member (their `wire_inputs`, which
    share per-row shapes), one after the other in member order."""
    request = oip.ModelInferRequest(model_name=model_name, model_version=version, id=request_id)
    for meta in signature.inputs:
        parts = [inputs[meta.name] for inputs in members]
        wire = parts[0] if len(parts) == 1 else np.concatenate(parts)
        request.inputs.add(name=meta.name, datatype=meta.datatype, shape=list(wire.shape))
        request.raw_input_contents.append(wire.tobytes())
    return request


def split_outputs(
    response: oip.ModelInferResponse, counts: Sequence[int]
) -> list[dict[str, gateway_pb2.Tensor]]:
    """Every output of an answer to a call carrying several members' rows, cut into each
    member's public Tensors (`counts`: each member's rows, in order); Internal when an
    output does not have one row per request row."""
    total = sum(counts)
    decoded = []
    for index, output in enumerate(response.outputs):
        values = decode_output(response, index)
        if values.ndim < 1 or values.shape[0] != total:
            raise Internal(
                f"model output {output.name!r} has shape {list(values.shape)} for {total} rows"
            )
        decoded.append((output.name, output.datatype, values))
    if not decoded:
        raise Internal("model answered no output")
    answers = []
    start = 0
    for count in counts:
        end = start + count
        answers.append(
            {name: to_public(values[start:end], datatype) for name, datatype, values in decoded}
        )
        start = end
    return answers


def scores_of(outputs: Mapping[str, gateway_pb2.Tensor], n_rows: int) -> list[float]:
    """`scores` for a model with one output of one number per row (the demo's `score`);
    empty for every other model, which answers in `outputs` alone."""
    if len(outputs) != 1:
        return []
    (tensor,) = outputs.values()
    if tensor.datatype == "BOOL":
        return []
    values = [float(v) for v in _values(tensor)]
    return values if len(values) == n_rows else []


def _values(tensor: gateway_pb2.Tensor) -> Sequence[float | int | bool]:
    values: Sequence[float | int | bool] = getattr(tensor, DATATYPES[tensor.datatype].public_field)
    return values


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
    return gateway_pb2.PredictResponse(
        scores=[score] * plan.n_rows,
        model_version=FALLBACK_VERSION,
        degraded=True,
        degraded_reason=reason,
        request_id=request_id,
    )
