"""Wires a model server replica from the mesh spec: registry channel, loads, servicer, server."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import grpc

from servemesh.control_credential import control_verifier
from servemesh.identity import dial_registry, serving_credentials
from servemesh.services.model.errors import ServingError
from servemesh.services.model.load_specs import LoadSpecs
from servemesh.services.model.loader import ModelLoader, registry_loader
from servemesh.services.model.metrics import add_batcher_metrics
from servemesh.services.model.readiness import ModelServer, routed_versions
from servemesh.services.model.repository import Key, ModelRepository, natural_key
from servemesh.services.model.servicer import InferenceServicer
from servemesh.services.model.shadow import ShadowLedger, ShadowRecorder, ledger_path
from servemesh.services.runtime import DeadlineBudget, ServiceServer
from servemesh.services.runtime.live_spec import SpecHook
from servemesh.services.runtime.tracing import client_interceptors
from servemesh.spec import MeshSpec, ResolvedSpec, SpecError
from servemesh.wire import OIP_SERVICE, message_size_options
from servemesh_api.inference import grpc_service_pb2_grpc

SERVICE_NAME = OIP_SERVICE


def _as_hook(close: Callable[[], None]):  # type: ignore[no-untyped-def]
    async def hook() -> None:
        close()

    return hook


log = logging.getLogger(__name__)


def expected_versions(spec: MeshSpec) -> list[tuple[str, str]]:
    """Every (model, version) the spec asks each model server to serve."""
    return [(name, version) for name, model in spec.models.items() for version in model.versions]


async def build_servicer(
    spec: MeshSpec, instance: str, loader: ModelLoader, shadow: ShadowRecorder | None = None
) -> InferenceServicer:
    """A servicer for `instance` with every version of the spec loaded and warmed up."""
    where = spec.instance(instance)
    if where.service != "model":
        raise SpecError(f"instance {instance!r} is a {where.service} instance, not a model server")
    servicer = InferenceServicer(
        replica=instance,
        zone=where.zone,
        loader=loader,
        expected=expected_versions(spec),
        budget=DeadlineBudget(
            spec.deadlines.hop_budget_ms / 1000, spec.deadlines.default_timeout_ms / 1000
        ),
        shadow=shadow,
    )
    try:
        await servicer.repository.load_all()
    except BaseException:
        await servicer.repository.close()
        raise
    return servicer


async def build_server(
    spec: ResolvedSpec, instance: str, *, loader: ModelLoader | None = None, tls: bool = True
) -> ServiceServer:
    """The model server for `instance`, returned unstarted with every version loaded.

    It binds its port and turns its health SERVING only after every version is loaded and
    warmed up, so Envoy never routes to a replica that cannot answer yet; afterwards its
    health (and OIP ServerReady) stays NOT_SERVING while any version the spec routes
    traffic to is unloaded (see `readiness`). Prometheus metrics are served at
    http://<metrics_address_of(instance)>/metrics (a free port when the spec names none).
    Its port is mutual TLS with the instance's mesh certificate; `tls=False` serves
    plaintext, for the side-by-side bench only (its peers, Triton and the echo server, are
    plaintext too). Without `loader` versions come from the registry at
    spec.registry_address. On drain (SIGTERM) the batchers finish what is queued and in
    flight, then the registry channel closes.
    """
    port = spec.port_of(instance)  # fail before minutes of loading, not after
    channel: grpc.aio.Channel | None = None
    specs = LoadSpecs(spec)
    if loader is None:
        size = spec.limits.max_message_bytes
        channel = dial_registry(spec, caller=instance).aio_channel(
            options=message_size_options(size),
            interceptors=client_interceptors(),
        )
        # Batching and latency of the spec of now, including entries a load brought.
        loader = registry_loader(channel, specs.current)
    # Answers of shadowed calls (both sides) go to a ledger for `routes shadow-report`.
    ledger = ShadowLedger(ledger_path(Path(spec.state_dir), instance))
    try:
        servicer = await build_servicer(spec, instance, loader, ShadowRecorder(ledger, instance))
    except BaseException:
        if channel is not None:
            await channel.close()
        raise
    server = ModelServer(
        instance,
        repository=servicer.repository,
        routed=routed_versions(spec),
        host=spec.listen_host,
        port=port,
        max_message_bytes=spec.limits.max_message_bytes,
        control_token=control_verifier(spec.state_dir),
        credentials=serving_credentials(spec, instance) if tls else None,
        service="model",
    )
    servicer.readiness = server.is_ready
    servicer.repository.configure = specs.bring
    servicer.repository.spec_names = lambda model, version: (
        version in (specs.spec.models[model].versions if model in specs.spec.models else ())
    )
    server.on_spec_change(follow_spec(server, servicer.repository, specs))
    server.add_service(
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, servicer, SERVICE_NAME
    )
    add_batcher_metrics(server.metrics.registry, servicer.repository.batchers)
    # Stop hooks run last-registered first: the batchers drain, then the channel and the
    # metrics endpoint close (scrapes see the drain's last counts).
    server.serve_metrics(spec.metrics_ports.get(instance, 0))
    server.on_stop(_as_hook(ledger.close))
    if channel is not None:
        server.on_stop(channel.close)
    server.on_stop(servicer.repository.close)
    return server


def _ordered(keys: set[Key]) -> list[Key]:
    return sorted(keys, key=lambda key: (key[0], natural_key(key[1])))


def follow_spec(server: ModelServer, repository: ModelRepository, specs: LoadSpecs) -> SpecHook:
    """The replica's hook for a new resolved spec (`servemesh apply`, `routes set`).

    Readiness follows the new routed set first (a routed version this replica lacks turns
    it NOT_SERVING at once); then versions the spec dropped are unloaded (their queued
    requests finish; Envoy stopped routing to them before the spec was written), and
    versions it lists that are not loaded are loaded, so a replica that missed a step (a
    restart, a failed load) catches up. Versions loaded outside the spec and never part of
    it (a RepositoryModelLoad of `servemesh apply` that has not written the spec yet) stay.
    """

    async def follow(spec: ResolvedSpec) -> None:
        before = set(expected_versions(specs.spec))
        specs.follow(spec)
        wanted = set(expected_versions(spec))
        await server.set_routed(routed_versions(spec))
        loaded = set(repository.models())
        for model, version in _ordered((before - wanted) & loaded):
            log.info("unloading: no longer in the spec", extra={"model": model, "version": version})
            try:
                await repository.unload(model, version)
            except ServingError:  # unloaded meanwhile (RepositoryModelUnload)
                continue
        for model, version in _ordered(wanted - loaded):
            if server.draining:
                return
            log.info("loading: new in the spec", extra={"model": model, "version": version})
            try:
                await repository.load(model, version)
            except Exception:  # the repository logged why; readiness says the rest
                continue

    return follow
