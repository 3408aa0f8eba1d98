"""Wires a model server replica from the mesh spec: registry channel, loads, servicer, server."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from servemesh.contract.control_credential import control_verifier
from servemesh.contract.inflight import InflightJournal, journal_path
from servemesh.contract.wire import OIP_SERVICE, message_size_options
from servemesh.identity import dial_registry, dial_registry_mirror, serving_credentials
from servemesh.services.model.errors import ServingError
from servemesh.services.model.load_specs import LoadSpecs
from servemesh.services.model.loader import ModelLoader, registry_loader
from servemesh.services.model.metrics import add_batcher_metrics, add_on_demand_metrics
from servemesh.services.model.on_demand import OnDemand
from servemesh.services.model.on_demand_servicer import OnDemandServicer
from servemesh.services.model.readiness import ModelServer, routed_versions
from servemesh.services.model.repository import Key, ModelRepository, natural_key
from servemesh.services.model.service import InferenceServicer
from servemesh.services.model.shadow import ShadowLedger, ShadowRecorder, ledger_path
from servemesh.services.runtime import DeadlineBudget, ServiceServer
from servemesh.services.runtime.confine import confine, server_policy
from servemesh.services.runtime.live_spec import SpecHook
from servemesh.services.runtime.tracing import client_interceptors
from servemesh.spec import SHARED_POOL, MeshSpec, ResolvedSpec, SpecError
from servemesh_api.inference import grpc_service_pb2_grpc

SERVICE_NAME = OIP_SERVICE


def _as_hook(close: Callable[[], None]):  # type: ignore[no-untyped-def]
    async def hook() -> None:
        close()

    return hook


log = logging.getLogger(__name__)


def expected_versions(spec: MeshSpec, pool: str = SHARED_POOL) -> list[tuple[str, str]]:
    """Every (model, version) the spec asks each model server of `pool` to serve."""
    return [
        (name, version)
        for name, model in spec.models.items()
        if spec.pool_of(name) == pool
        for version in model.versions
    ]


def pool_on_demand(spec: MeshSpec, pool: str) -> OnDemand | None:
    """How a server of `pool` loads on demand (its budget), None for an eager pool (the
    shared one always: `pools:` names only pools a model is placed on)."""
    settings = spec.pools.get(pool) if pool else None
    if settings is None or not settings.on_demand:
        return None
    return OnDemand(budget_bytes=settings.memory_budget)


def pool_routed_versions(spec: MeshSpec, pool: str) -> set[tuple[str, str]]:
    """The routed versions a server of `pool` must hold to be ready: its pool's only."""
    return {key for key in routed_versions(spec) if spec.pool_of(key[0]) == pool}


async def build_servicer(
    spec: MeshSpec, instance: str, loader: ModelLoader, shadow: ShadowRecorder | None = None
) -> InferenceServicer:
    """A servicer for `instance` with every version of the spec loaded and warmed up (on
    demand: none loaded, each loads on its first call)."""
    where = spec.instance(instance)
    if where.service != "model":
        raise SpecError(f"instance {instance!r} is a {where.service} instance, not a model server")
    on_demand = pool_on_demand(spec, where.pool)
    make = (
        InferenceServicer
        if on_demand is None
        else functools.partial(OnDemandServicer, on_demand=on_demand)
    )
    servicer = make(
        replica=instance,
        zone=where.zone,
        loader=loader,
        expected=expected_versions(spec, where.pool),
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
    spec: ResolvedSpec,
    instance: str,
    *,
    loader: ModelLoader | None = None,
    tls: bool = True,
    confined: bool = False,
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
    channels: list[grpc.aio.Channel] = []
    specs = LoadSpecs(spec)
    if loader is None:
        size = spec.limits.max_message_bytes
        # The registry, then the zone's mirror of it (registry.mirrors) for when the
        # registry does not answer.
        dials = [dial_registry(spec, caller=instance)]
        mirror = dial_registry_mirror(spec, spec.instance(instance).zone, caller=instance)
        dials += [mirror] if mirror is not None else []
        channels = [
            dial.aio_channel(options=message_size_options(size), interceptors=client_interceptors())
            for dial in dials
        ]
        # Batching and latency of the spec of now, including entries a load brought.
        loader = registry_loader(channels, specs.current)
    # Answers of shadowed calls (both sides) go to a ledger for `routes shadow-report`.
    ledger = ShadowLedger(ledger_path(Path(spec.state_dir), instance))
    try:
        servicer = await build_servicer(spec, instance, loader, ShadowRecorder(ledger, instance))
    except BaseException:
        for channel in channels:
            await channel.close()
        raise
    if confined and spec.sandbox.syscall_filter:
        # Model code has run (warm-up); from here on it runs confined, and so does whatever
        # it might make of this process. Only a process of its own (the entry point, a
        # bench server): the walls cannot come down, and a caller in process keeps going.
        confine(server_policy(spec.sandbox.model_address_space_gib << 30))
        log.info("confined: syscall filter on", extra={"profile": "server"})
    server = ModelServer(
        instance,
        repository=servicer.repository,
        routed=pool_routed_versions(spec, spec.instance(instance).pool),
        stall_s=spec.sandbox.liveness.stall_s,
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
    server.on_spec_change(
        follow_spec(server, servicer.repository, specs, spec.instance(instance).pool)
    )
    server.add_service(
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, servicer, SERVICE_NAME
    )
    add_batcher_metrics(server.metrics.registry, servicer.repository.batchers)
    if servicer.repository.on_demand is not None:
        add_on_demand_metrics(server.metrics.registry, servicer.repository)
    # Each model thread's batch in flight, for the launcher to name after a crash.
    journal = InflightJournal(journal_path(spec.state_dir, instance))
    attach = journal_slots(servicer.repository, journal)
    await attach()
    servicer.repository.on_change(attach)
    # Stop hooks run last-registered first: the batchers drain, then the channel and the
    # metrics endpoint close (scrapes see the drain's last counts).
    server.serve_metrics(spec.metrics_ports.get(instance, 0))
    server.on_stop(_as_hook(ledger.close))
    server.on_stop(_as_hook(journal.close))
    for channel in channels:
        server.on_stop(channel.close)
    server.on_stop(servicer.repository.close)
    return server


def journal_slots(
    repository: ModelRepository, journal: InflightJournal
) -> Callable[[], Awaitable[None]]:
    """A repository listener that gives every served version's batcher its slot of the
    in-flight journal (servemesh.contract.inflight), on every install (a load, a reload, a live
    apply's version)."""

    async def attach() -> None:
        for model, version, batcher in repository.batchers():
            if batcher.journal is None:
                batcher.journal = journal.slot(model, version)

    return attach


def _ordered(keys: set[Key]) -> list[Key]:
    return sorted(keys, key=lambda key: (key[0], natural_key(key[1])))


def follow_spec(
    server: ModelServer, repository: ModelRepository, specs: LoadSpecs, pool: str = SHARED_POOL
) -> SpecHook:
    """The replica's hook for a new resolved spec (`servemesh apply`, `routes set`).

    Readiness follows the new routed set first (a routed version this replica lacks turns
    it NOT_SERVING at once); then versions the spec dropped are unloaded (their queued
    requests finish; Envoy stopped routing to them before the spec was written), and
    versions it lists that are not loaded are loaded, so a replica that missed a step (a
    restart, a failed load) catches up. Versions loaded outside the spec and never part of
    it (a RepositoryModelLoad of `servemesh apply` that has not written the spec yet) stay.
    """

    async def follow(spec: ResolvedSpec) -> None:
        before = set(expected_versions(specs.spec, pool))
        specs.follow(spec)
        wanted = set(expected_versions(spec, pool))
        if repository.on_demand is not None:
            # Loadable before routed: a version the spec just added is not "missing".
            repository.loadable = (repository.loadable - (before - wanted)) | wanted
            settings = spec.pools.get(pool) if pool else None
            if settings is not None and settings.memory_budget is not None:
                repository.on_demand.budget_bytes = settings.memory_budget
        await server.set_routed(pool_routed_versions(spec, pool))
        loaded = set(repository.models())
        for model, version in _ordered((before - wanted) & loaded):
            log.info("unloading: no longer in the spec", extra={"model": model, "version": version})
            try:
                await repository.unload(model, version)
            except ServingError:  # unloaded meanwhile (RepositoryModelUnload)
                continue
        if repository.on_demand is not None:
            return  # the versions it lists load on their first calls
        for model, version in _ordered(wanted - loaded):
            if server.draining:
                return
            log.info("loading: new in the spec", extra={"model": model, "version": version})
            try:
                await repository.load(model, version)
            except Exception:  # the repository logged why; readiness says the rest
                continue

    return follow
