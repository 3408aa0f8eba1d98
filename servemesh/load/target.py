"""What a load sends to: an address and a way to build request i on an open channel.

The channel is opened by the load itself, on the event loop that sends (a background load
runs its own loop in a thread, and a grpc.aio channel belongs to one loop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from servemesh.identity.channels import Dial
from servemesh.load.outcome import NO_REPLY, Reply, Request
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class Target:
    address: str
    request: Callable[[grpc.aio.Channel], Request]
    options: ChannelOptions = field(default_factory=tuple)
    # TLS for the channel (None: plaintext).
    credentials: grpc.ChannelCredentials | None = None

    def open_channel(self) -> grpc.aio.Channel:
        return Dial(self.address, self.credentials, tuple(self.options)).aio_channel()


def predict_target(
    edge: Dial | str,
    *,
    model: str = "fraud",
    entities: int = 100,
    timeout_s: float = 2.0,
    metadata: Sequence[tuple[str, str]] | Callable[[], Sequence[tuple[str, str]]] = (),
    entity_ids: Sequence[str] = (),
) -> Target:
    """Gateway Predict for one entity per call, cycling through `entity_ids`, else
    `user-0`..`user-<entities-1>` (the demo's seeded entities), to the edge `edge` leads to
    (an address: plaintext). `metadata`: sent with every call, or a function asked for it
    at every call (credentials that are renewed while a load runs)."""
    dial = Dial(edge, None) if isinstance(edge, str) else edge
    ids = list(entity_ids) or [f"user-{i}" for i in range(max(1, entities))]
    fixed = None if callable(metadata) else (tuple(metadata) or None)

    def metadata_now() -> tuple[tuple[str, str], ...] | None:
        if callable(metadata):
            return tuple(metadata()) or None
        return fixed

    def build(channel: grpc.aio.Channel) -> Request:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def predict(index: int) -> Reply:
            request = gateway_pb2.PredictRequest(model=model, entity_ids=[ids[index % len(ids)]])
            reply = await stub.Predict(request, timeout=timeout_s, metadata=metadata_now())
            return Reply(
                reply.model_version,
                reply.model_replica,
                reply.model_zone,
                reply.degraded,
                reply.degraded_reason,
            )

        return predict

    return Target(dial.address, build, dial.options, dial.credentials)


def features_target(
    dial: Dial,
    *,
    view: str,
    features: Sequence[str],
    entities: int = 100,
    timeout_s: float = 2.0,
) -> Target:
    """GetFeatures of one entity per call (`user-0`..), packed, as a gateway reads: through
    the Envoy mesh listener `dial` leads to (a zone's), or a feature service's own port."""
    ids = [f"user-{i}" for i in range(max(1, entities))]
    names = list(features)

    def build(channel: grpc.aio.Channel) -> Request:
        from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc

        stub = feature_pb2_grpc.FeatureServiceStub(channel)

        async def get(index: int) -> Reply:
            request = feature_pb2.GetFeaturesRequest(
                view=view, entity_ids=[ids[index % len(ids)]], feature_names=names, packed=True
            )
            await stub.GetFeatures(request, timeout=timeout_s)
            return NO_REPLY

        return get

    return Target(dial.address, build, dial.options, dial.credentials)


def raw_target(
    address: str,
    method: str,
    bodies: Sequence[bytes],
    *,
    timeout_for: Callable[[int], float],
    options: ChannelOptions = (),
) -> Target:
    """A unary call to `method` with pre-serialised bodies (request i sends body i modulo
    their number) whose answers are never parsed: the client stays out of the measurement.
    `timeout_for(i)` is request i's deadline in seconds."""
    if not bodies:
        raise ValueError("raw_target needs at least one request body")

    def build(channel: grpc.aio.Channel) -> Request:
        call = channel.unary_unary(method)

        async def send(index: int) -> Reply:
            await call(bodies[index % len(bodies)], timeout=timeout_for(index))
            return Reply()

        return send

    return Target(address, build, tuple(options))
