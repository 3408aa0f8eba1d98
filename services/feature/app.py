"""Wires the feature service from the mesh spec: Redis client, store, servicer, server."""

from __future__ import annotations

from servemesh.contract.control_credential import control_verifier
from servemesh.contract.wire import FEATURE_SERVICE
from servemesh.identity import serving_credentials
from servemesh.services.feature.changes import ChangeHub
from servemesh.services.feature.health import watch_store
from servemesh.services.feature.metrics import FeatureMetrics
from servemesh.services.feature.replica import store_clients
from servemesh.services.feature.service import FeatureServicer
from servemesh.services.feature.store import RedisFeatureStore
from servemesh.services.runtime import DeadlineBudget, ServiceServer
from servemesh.spec import ResolvedSpec
from servemesh_api.feature.v1 import feature_pb2_grpc


async def build_server(spec: ResolvedSpec, instance: str, *, tls: bool = True) -> ServiceServer:
    """The instance's server, unstarted; mutual TLS on its port (`tls=False`: plaintext, for
    tests of the service's own behaviour, never a running mesh)."""
    password = spec.redis_password()
    zone = spec.instance(instance).zone
    clients = store_clients(spec, zone)
    client = clients.writer
    store = RedisFeatureStore(
        client,
        spec.feature_store.key_prefix,
        reader=clients.reader,
        lag_s=clients.lag,
        # A replicated store acknowledges a load once a replica holds it too.
        load_ack_replicas=1 if spec.feature_store.topology == "replicated" else 0,
    )
    server = ServiceServer(
        instance,
        host=spec.listen_host,
        port=spec.port_of(instance),
        max_message_bytes=spec.limits.max_message_bytes,
        control_token=control_verifier(spec.state_dir),
        credentials=serving_credentials(spec, instance) if tls else None,
        service="feature",
    )
    metrics = FeatureMetrics(server.metrics.registry)
    if clients.lag is not None:
        clients.lag.on_change = metrics.replica_lag.labels(zone).set
        clients.lag.start()
    servicer = FeatureServicer(
        store,
        spec.feature_views,
        spec.feature_store,
        DeadlineBudget(
            spec.deadlines.hop_budget_ms / 1000, spec.deadlines.default_timeout_ms / 1000
        ),
        max_entities=spec.limits.max_rows_per_predict,
        limits=spec.limits,
        metrics=metrics,
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
    server.on_stop(clients.close)
    # SERVING only while the Redis it reads answers (a replicated store: the zone's
    # replica, or the primary its reads fall over to); a read that cannot reach either
    # probes at once.
    primary = None if clients.reader is clients.writer else clients.writer
    servicer.store_unreachable = watch_store(
        server, clients.read_url, password, primary=primary
    ).poke
    server.serve_metrics(spec.metrics_ports.get(instance, 0))
    return server
