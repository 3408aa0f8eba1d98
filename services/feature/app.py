"""Wires the feature service from the mesh spec: Redis client, store, servicer, server."""

from __future__ import annotations

import redis.asyncio as aioredis

from servemesh.control_credential import control_verifier
from servemesh.identity import serving_credentials
from servemesh.services.feature.changes import ChangeHub
from servemesh.services.feature.health import watch_store
from servemesh.services.feature.metrics import FeatureMetrics
from servemesh.services.feature.service import FeatureServicer
from servemesh.services.feature.store import RedisFeatureStore
from servemesh.services.runtime import DeadlineBudget, ServiceServer
from servemesh.spec import ResolvedSpec
from servemesh.wire import FEATURE_SERVICE
from servemesh_api.feature.v1 import feature_pb2_grpc


async def build_server(spec: ResolvedSpec, instance: str, *, tls: bool = True) -> ServiceServer:
    """The instance's server, unstarted; mutual TLS on its port (`tls=False`: plaintext, for
    tests of the service's own behaviour, never a running mesh)."""
    password = spec.redis_password()
    client = aioredis.Redis.from_url(
        spec.redis_url, password=password, socket_connect_timeout=1.0, health_check_interval=10
    )
    store = RedisFeatureStore(client, spec.feature_store.key_prefix)
    server = ServiceServer(
        instance,
        host=spec.listen_host,
        port=spec.port_of(instance),
        max_message_bytes=spec.limits.max_message_bytes,
        control_token=control_verifier(spec.state_dir),
        credentials=serving_credentials(spec, instance) if tls else None,
        service="feature",
    )
    servicer = FeatureServicer(
        store,
        spec.feature_views,
        spec.feature_store,
        DeadlineBudget(
            spec.deadlines.hop_budget_ms / 1000, spec.deadlines.default_timeout_ms / 1000
        ),
        max_entities=spec.limits.max_rows_per_predict,
        limits=spec.limits,
        metrics=FeatureMetrics(server.metrics.registry),
        changes=ChangeHub(client, spec.feature_store.key_prefix),
    )
    server.add_service(
        feature_pb2_grpc.add_FeatureServiceServicer_to_server,
        servicer,
        FEATURE_SERVICE,
    )

    async def follow(new: ResolvedSpec) -> None:
        # Views added or removed by `servemesh apply` (a view's data stays in Redis).
        servicer.views = dict(new.feature_views)

    server.on_spec_change(follow)
    if servicer.changes is not None:
        server.on_stop(servicer.changes.close)
    server.on_stop(client.aclose)
    # SERVING only while Redis answers; a read that cannot reach it probes at once.
    servicer.store_unreachable = watch_store(server, spec.redis_url, password).poke
    server.serve_metrics(spec.metrics_ports.get(instance, 0))
    return server
