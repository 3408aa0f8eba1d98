"""FeatureService: bulk feature reads and writes over the Redis online store."""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import redis.exceptions

from servemesh.services.feature.store import RedisFeatureStore
from servemesh.services.runtime import DeadlineBudget, bind_request_id, request_id_from
from servemesh.services.runtime.deadlines import DeadlineExhausted
from servemesh.services.runtime.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from servemesh.spec import FeatureStoreSpec
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

_VIEW = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
MAX_ID_LENGTH = 256


def validate_get(request: feature_pb2.GetFeaturesRequest, max_entities: int) -> None:
    """Raise InvalidArgument naming the first bad field of a GetFeatures request."""
    _check_view(request.view)
    if not request.entity_ids:
        raise InvalidArgument("entity_ids: give at least one entity")
    if len(request.entity_ids) > max_entities:
        raise InvalidArgument(
            f"entity_ids: {len(request.entity_ids)} entities, at most {max_entities} per call",
        )
    for i, entity_id in enumerate(request.entity_ids):
        _check_id(f"entity_ids[{i}]", entity_id)
    if not request.feature_names:
        raise InvalidArgument("feature_names: give at least one feature")
    for i, name in enumerate(request.feature_names):
        _check_id(f"feature_names[{i}]", name)


def validate_write(request: feature_pb2.WriteFeaturesRequest, max_entities: int) -> None:
    _check_view(request.view)
    if len(request.entities) > max_entities:
        raise InvalidArgument(
            f"entities: {len(request.entities)} entities, at most {max_entities} per call",
        )
    for i, entity in enumerate(request.entities):
        _check_id(f"entities[{i}].entity_id", entity.entity_id)
        if not entity.values:
            raise InvalidArgument(f"entities[{i}].values: empty")
        for name, value in entity.values.items():
            _check_id(f"entities[{i}].values key", name)
            if not math.isfinite(value):
                raise InvalidArgument(
                    f"entities[{i}].values[{name!r}]: not a finite number",
                )


def _check_view(view: str) -> None:
    if not _VIEW.match(view):
        raise InvalidArgument(
            f"view: {view!r} is not a view name (lowercase letters, digits, '-' and '_')",
        )


def _check_id(field: str, value: str) -> None:
    if not value:
        raise InvalidArgument(f"{field}: empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgument(f"{field}: longer than {MAX_ID_LENGTH}")


def assemble(
    request: feature_pb2.GetFeaturesRequest,
    stored: list[list[float | None]],
    policy: FeatureStoreSpec,
) -> feature_pb2.GetFeaturesResponse:
    """Build the response from stored values, applying the missing-entity policy."""
    response = feature_pb2.GetFeaturesResponse()
    missing: list[str] = []
    for entity_id, values in zip(request.entity_ids, stored, strict=True):
        gaps = [name for name, v in zip(request.feature_names, values, strict=True) if v is None]
        if gaps and policy.missing_entity == "error":
            missing.append(
                entity_id if len(gaps) == len(values) else f"{entity_id} (lacks {gaps[:5]})"
            )
            continue
        response.vectors.add(
            entity_id=entity_id,
            values=[policy.default_value if v is None else v for v in values],
            defaulted=bool(gaps),
        )
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        raise NotFound(f"entity_ids: not in feature view {request.view!r}: {shown}")
    return response


class FeatureServicer(feature_pb2_grpc.FeatureServiceServicer):
    def __init__(
        self,
        store: RedisFeatureStore,
        policy: FeatureStoreSpec,
        budget: DeadlineBudget,
        max_entities: int,
    ) -> None:
        self.store = store
        self.policy = policy
        self.budget = budget
        self.max_entities = max_entities

    async def GetFeatures(
        self, request: feature_pb2.GetFeaturesRequest, context: grpc.aio.ServicerContext
    ) -> feature_pb2.GetFeaturesResponse:
        bind_request_id(request_id_from(context.invocation_metadata()))
        validate_get(request, self.max_entities)
        stored = await self._call_store(
            context, self.store.read(request.view, request.entity_ids, request.feature_names)
        )
        return assemble(request, stored, self.policy)

    async def WriteFeatures(
        self, request: feature_pb2.WriteFeaturesRequest, context: grpc.aio.ServicerContext
    ) -> feature_pb2.WriteFeaturesResponse:
        bind_request_id(request_id_from(context.invocation_metadata()))
        validate_write(request, self.max_entities)
        entities = {e.entity_id: dict(e.values) for e in request.entities}
        written = await self._call_store(context, self.store.write(request.view, entities))
        return feature_pb2.WriteFeaturesResponse(written=written)

    async def _call_store(
        self, context: grpc.aio.ServicerContext, call: Coroutine[Any, Any, T]
    ) -> T:
        """Run a store call inside the caller's deadline; map Redis failures to statuses."""
        try:
            timeout = self.budget.remaining(self.budget.absolute_deadline(context))
            return await asyncio.wait_for(call, timeout)
        except DeadlineExhausted as exc:
            call.close()
            raise DeadlineExceeded(f"no time left for the store: {exc}") from None
        except TimeoutError:
            raise DeadlineExceeded("feature store did not answer in time") from None
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            log.warning("feature store unreachable", extra={"error": str(exc)})
            raise Unavailable("feature store unavailable") from None
