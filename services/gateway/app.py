"""Wires the gateway from the mesh spec: one channel to Envoy's mesh listener, the servicer."""

from __future__ import annotations

import grpc

from servemesh.control_credential import read_control_token
from servemesh.services.gateway.health import watch_dependencies
from servemesh.services.gateway.service import GatewayServicer
from servemesh.services.runtime import ServiceServer
from servemesh.services.runtime.tracing import client_interceptors
from servemesh.spec import ResolvedSpec
from servemesh.wire import GATEWAY_SERVICE, message_size_options
from servemesh_api.gateway.v1 import gateway_pb2_grpc


async def build_server(spec: ResolvedSpec, instance: str) -> ServiceServer:
    limit = spec.limits.max_message_bytes
    # Every downstream call goes through Envoy, which owns retries and load balancing.
    mesh_channel = grpc.aio.insecure_channel(
        # This zone's mesh listener: its clusters prefer replicas in the same zone.
        spec.mesh_address_for(spec.instance(instance).zone),
        options=[
            *message_size_options(limit),
            ("grpc.enable_retries", 0),
        ],
        interceptors=client_interceptors(),
    )
    server = ServiceServer(
        instance,
        host=spec.host,
        port=spec.port_of(instance),
        max_message_bytes=limit,
        control_token=read_control_token(spec.state_dir),
    )
    servicer = GatewayServicer(spec, mesh_channel)
    server.add_service(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, GATEWAY_SERVICE)
    # Models and versions added or removed by `servemesh apply` are served (or refused) as
    # soon as the spec file says so.
    server.on_spec_change(servicer.follow_spec)
    server.on_stop(mesh_channel.close)
    # SERVING only while it can answer: the mesh listener and the replicas it needs.
    watch_dependencies(server, spec, instance)
    return server
