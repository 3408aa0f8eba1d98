"""Wires the gateway from the mesh spec: one channel to Envoy's mesh listener, the servicer."""

from __future__ import annotations

import asyncio

import grpc

from servemesh.contract.wire import GATEWAY_SERVICE, OIP_SERVICE, message_size_options
from servemesh.identity import dial_mesh, mesh_identity, serving_credentials
from servemesh.identity.watch import follow_certificate
from servemesh.predlog import gateway_prediction_log
from servemesh.services.gateway.feed import follow_feed
from servemesh.services.gateway.health import watch_dependencies
from servemesh.services.gateway.metrics import PredictMetrics
from servemesh.services.gateway.oip import EdgeInference
from servemesh.services.gateway.service import GatewayServicer
from servemesh.services.runtime import ServiceServer
from servemesh.spec import ResolvedSpec
from servemesh_api.gateway.v1 import gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2_grpc


async def build_server(spec: ResolvedSpec, instance: str, *, tls: bool = True) -> ServiceServer:
    """The instance's server, unstarted; mutual TLS on its port (`tls=False`: plaintext, for
    tests of the service's own behaviour, never a running mesh)."""
    limit = spec.limits.max_message_bytes

    def dial() -> grpc.aio.Channel:
        # Every downstream call goes through Envoy, which owns retries and load balancing:
        # this zone's mesh listener, whose clusters prefer replicas in the same zone.
        return dial_mesh(spec, spec.instance(instance).zone, caller=instance).aio_channel(
            # No client interceptors: grpc.aio's intercepted-call path cost more than the
            # spans themselves; the servicer puts the trace context on each call
            # (tracing.traced_call).
            options=[*message_size_options(limit), ("grpc.enable_retries", 0)],
        )

    mesh_channel = dial()
    server = ServiceServer(
        instance,
        host=spec.listen_host,
        port=spec.port_of(instance),
        max_message_bytes=limit,
        # No control method here: the gateway holds no control credential, not even the
        # digest the other services check calls against.
        control_token=None,
        credentials=serving_credentials(spec, instance) if tls else None,
        service="gateway",
    )
    predictions = gateway_prediction_log(spec, instance, spec.instance(instance).zone)
    predictions.start()
    servicer = GatewayServicer(
        spec, mesh_channel, PredictMetrics(server.metrics.registry), predictions
    )
    server.add_service(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, GATEWAY_SERVICE)
    # OIP for callers at the edge (gRPC, or REST through the edge's transcoder): oip.py.
    server.add_service(
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
        EdgeInference(servicer),
        OIP_SERVICE,
    )
    # The file `servemesh apply` rewrites (known once the server follows it): the servicer
    # sends calls alone while it changed and is not yet followed.
    servicer.spec_file = lambda: server.live_spec.path if server.live_spec is not None else None
    # Models and versions added or removed by `servemesh apply` are served (or refused) as
    # soon as the spec file says so.
    server.on_spec_change(servicer.follow_spec)
    server.on_spec_change(predictions.follow_spec)
    # Stop hooks run once every call has ended: the log flushes what is left.
    server.on_stop(predictions.close)
    # SERVING only while it can answer: the mesh listener and the replicas it needs.
    health = watch_dependencies(server, spec, instance)
    # The store's change feed, followed while a model's cache answers on its word.
    followed = [spec]

    async def follow(new: ResolvedSpec) -> None:
        followed[0] = new

    server.on_spec_change(follow)
    tiers = servicer.tiers
    if tiers.wants_feed():
        tiers.feed_wanted.set()
    server.run_in_background(
        follow_feed(
            lambda: followed[0],
            spec.instance(instance).zone,
            instance,
            tiers.feed,
            tiers.wants_feed,
            tiers.feed_changed,
            tiers.feed_broke,
            tiers.feed_wanted,
        )
    )
    channels = [mesh_channel]

    async def redial() -> None:
        # A rotated certificate: new calls go out on a channel that presents it; calls
        # under way finish on the old one, closed once they are surely done.
        fresh = dial()
        servicer.use_channel(fresh)
        channels.append(fresh)
        await health.redial()
        old = channels.pop(0)
        server.run_in_background(_close_later(old, CLOSE_AFTER_S))

    async def close_all() -> None:
        for channel in channels:
            await channel.close()

    server.on_stop(close_all)
    server.run_in_background(follow_certificate(mesh_identity(spec), instance, redial))
    server.serve_metrics(spec.metrics_ports.get(instance, 0))
    return server


# Calls in flight on a channel replaced by a rotation finish within their deadline.
CLOSE_AFTER_S = 60.0


async def _close_later(channel: grpc.aio.Channel, after_s: float) -> None:
    try:
        await asyncio.sleep(after_s)
    finally:
        await channel.close()
