"""Wires the registry from the mesh spec: store under state_dir, servicer, server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc

from servemesh.contract.control_credential import control_verifier
from servemesh.identity import serving_credentials
from servemesh.registry.backup import BackupMetrics, backup_every
from servemesh.registry.drift import DriftMetrics, drift_every
from servemesh.registry.metrics import RegistryMetrics
from servemesh.registry.scope import ModelServerScope
from servemesh.registry.service import SERVICE_NAME, UPLOAD_IDLE_TIMEOUT_S, RegistryServicer
from servemesh.registry.store import RegistryStore
from servemesh.services.runtime import ServiceServer
from servemesh.spec import ResolvedSpec, SpecError
from servemesh_api.registry.v1 import registry_pb2_grpc


def registry_server(
    store: RegistryStore,
    name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = 4 * 1024 * 1024,
    control_token: str | None = None,
    upload_idle_timeout_s: float = UPLOAD_IDLE_TIMEOUT_S,
    credentials: grpc.ServerCredentials | None = None,
    scope: ModelServerScope | None = None,
    make_servicer: Callable[..., RegistryServicer] = RegistryServicer,
) -> ServiceServer:
    """A not yet started server for `store`; it closes the store when it stops. Its control
    calls (CreateModel, UploadVersion, SetAlias) answer only to `control_token`.
    `make_servicer` builds the servicer from the store and its keyword arguments (a
    mirror's, registry/mirror.py)."""
    server = ServiceServer(
        name,
        host=host,
        port=port,
        max_message_bytes=max_message_bytes,
        control_token=control_token,
        credentials=credentials,
        service="registry",
    )
    servicer = make_servicer(
        store,
        upload_idle_timeout_s=upload_idle_timeout_s,
        metrics=RegistryMetrics(server.metrics.registry),
        scope=scope,
    )
    server.add_service(registry_pb2_grpc.add_RegistryServicer_to_server, servicer, SERVICE_NAME)

    async def close_store() -> None:
        await asyncio.to_thread(store.close)

    server.on_stop(close_store)
    return server


async def open_store(spec: ResolvedSpec, root: Path) -> RegistryStore:
    """The registry store at `root` with the spec's limits (the registry's, a mirror's)."""
    return await asyncio.to_thread(
        RegistryStore, root, spec.limits.max_artifact_bytes, spec.limits.registry_quota_bytes
    )


def mesh_registry_server(
    spec: ResolvedSpec,
    name: str,
    store: RegistryStore,
    port: int,
    make_servicer: Callable[..., RegistryServicer] = RegistryServicer,
) -> ServiceServer:
    """`store` served as the mesh's process `name` on `port`: the spec's message and upload
    limits, the control credential, `name`'s certificate, and model servers held to their
    own pool's models (registry/scope.py) by the spec the server follows."""
    server: ServiceServer | None = None

    def current() -> ResolvedSpec:
        live = server.live_spec if server is not None else None
        return live.current if live is not None else spec

    async def refresh() -> bool:
        live = server.live_spec if server is not None else None
        return await live.refresh() if live is not None else False

    server = registry_server(
        store,
        name,
        host=spec.listen_host,
        port=port,
        max_message_bytes=spec.limits.max_message_bytes,
        control_token=control_verifier(spec.state_dir),
        upload_idle_timeout_s=spec.limits.upload_idle_timeout_s,
        credentials=serving_credentials(spec, name),
        scope=ModelServerScope(current, refresh),
        make_servicer=make_servicer,
    )
    return server


async def build_server(spec: ResolvedSpec, instance: str) -> ServiceServer:
    """The registry instance `instance` of `spec`, state under <state_dir>/registry."""
    if spec.instance(instance).service != "registry":
        raise SpecError(f"instance {instance!r} is not a registry instance")
    store = await open_store(spec, spec.registry_store_dir)
    server = mesh_registry_server(spec, instance, store, spec.port_of(instance))
    server.serve_metrics(spec.metrics_ports.get(instance, 0))

    def current() -> ResolvedSpec:
        return server.live_spec.current if server.live_spec is not None else spec

    server.run_in_background(drift_every(current, DriftMetrics(server.metrics.registry)))
    backups = spec.registry.backup
    if backups.interval_s is not None:
        metrics = BackupMetrics(server.metrics.registry)
        every = backup_every(
            backups.interval_s, spec.registry_store_dir, spec.registry_backup_dir, backups.keep,
            metrics,
        )  # fmt: skip
        server.run_in_background(every)
    return server
