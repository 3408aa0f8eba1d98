"""Captured calls made by hand, as a gateway's watch would make them, and a store the
test holds."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import grpc
import numpy as np

from servemesh.predlog.record import PredictWatch, Row, RowContext, to_row
from servemesh.services.runtime.errors import MeshError
from servemesh.spec import ModelInputSpec
from servemesh_api.gateway.v1 import gateway_pb2

CONTEXT = RowContext("gateway-zone-a-0", "zone-a", entity_of_model={"fraud": "user"})
# The three features of the records' `fraud` (the shorthand's one input, `features`), and a
# context whose spec logs them.
FEATURES = ("f00", "f01", "f02")
LOGGED = replace(
    CONTEXT,
    logged_features={"fraud": {"features": ModelInputSpec(view="user", features=list(FEATURES))}},
)


class Meta(NamedTuple):
    """One input of a model's signature, as the gateway learns it."""

    name: str
    datatype: str


TYPES = (Meta("features", "FP32"),)


def vector(*rows: Sequence[float]) -> dict[str, np.ndarray]:
    """The model inputs of a call of `fraud` sending these rows."""
    return {"features": np.asarray(rows, dtype=np.float32)}


def answer(score: float = 0.5, version: str = "v1") -> gateway_pb2.PredictResponse:
    return gateway_pb2.PredictResponse(
        scores=[score],
        model_version=version,
        model_replica="model-fraud-zone-a-0",
        model_zone="zone-a",
        outputs={"score": gateway_pb2.Tensor(datatype="FP32", shape=[1, 1], float_values=[score])},
    )


def captured(
    at: float,
    *,
    request_id: str = "r",
    total_ms: float = 5.0,
    status: str = "OK",
    entity_ids: tuple[str, ...] = ("user-1",),
    entity_rows: tuple[dict[str, str], ...] = (),
    model: str = "fraud",
    version: str = "v1",
    degraded: bool = False,
    tier: gateway_pb2.Tier = gateway_pb2.TIER_ONLINE,
    inputs: Mapping[str, np.ndarray] | None = None,
) -> PredictWatch:
    """A finished call at time `at`, as its watch hands it to the log."""
    ended: list[PredictWatch] = []
    request = gateway_pb2.PredictRequest(
        model=model,
        version="" if status == "OK" else version,
        entity_ids=list(entity_ids),
        entities=[gateway_pb2.EntityRow(ids=r) for r in entity_rows],
    )
    watch = PredictWatch(ended.append, 64, request, request_id, ())
    watch.feature_s = 0.001
    if inputs is not None:
        watch.model_inputs(TYPES, inputs)
    if status == "OK":
        reply = answer(version=version)
        reply.tier = tier
        if degraded:
            reply.degraded = True
            reply.degraded_reason = "feature service: down"
        watch.inference_s = 0.002
        watch.answered(reply)
    else:
        watch.failed(MeshError(f"{status.lower()}: something", code=grpc.StatusCode[status]))
    watch.at = at
    watch.total_s = total_ms / 1000
    return ended[0]


def row(at: float, *, context: RowContext = CONTEXT, **kwargs: Any) -> Row:
    return to_row(captured(at, **kwargs), context)


class BlockedStore:
    """A store whose writes wait until the test releases them."""

    kind = "blocked"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.rows: list[Row] = []
        self.fail = False
        self.expired_before: list[int] = []

    def describe(self) -> str:
        return "a store held by the test"

    def write(self, rows: Sequence[Row]) -> None:
        self.entered.set()
        if not self.release.wait(timeout=60):
            raise TimeoutError("the test never released the store")
        if self.fail:
            raise OSError("disk full")
        self.rows.extend(rows)

    def compact(self) -> None:
        pass

    def expire(self, before_ms: int) -> int:
        self.expired_before.append(before_ms)
        return 0

    def close(self) -> None:
        pass
