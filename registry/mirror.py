"""A zone's read-only mirror of the registry (registry.mirrors: per_zone).

The registry lives in the first zone. Were that zone lost, the other zones' model servers
could neither start nor load: every artifact comes from the registry. So each other zone
runs a mirror: a registry service over a store of its own, which pulls from the registry
what it lacks (every `registry.mirror_sync`, and at once for a version asked of it that it
does not hold) and answers reads only. Its zone's model servers fetch from it when the
registry does not answer (services/model/loader.py).

Nothing is trusted more than before: a mirrored version goes through the store's own
upload path, so its bytes are checked against the size and sha256 the registry's record
declares before the version exists here, and a model server checks them again on
download. A mirror holding a version under other bytes than the registry's says so in its
log and keeps what it has (versions are immutable; the registry's own restore refuses the
same clash). Pushes, aliases and new models go to the registry alone: a mirror refuses them
with FAILED_PRECONDITION naming where to send them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import grpc

from servemesh.contract.wire import message_size_options
from servemesh.identity import dial_registry
from servemesh.registry.app import mesh_registry_server, open_store
from servemesh.registry.client import fetch_verified
from servemesh.registry.convert import header_from_proto
from servemesh.registry.errors import AlreadyExistsError, NotFoundError, RegistryError
from servemesh.registry.metrics import RegistryMetrics
from servemesh.registry.scope import ModelServerScope
from servemesh.registry.service import UPLOAD_IDLE_TIMEOUT_S, RegistryServicer
from servemesh.registry.store import RegistryStore
from servemesh.services.runtime import ServiceServer
from servemesh.spec import Instance, ResolvedSpec, SpecError, registry_mirror_name
from servemesh.spec.fleet import REGISTRY_MIRROR_PREFIX
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

# How long a read that missed waits for the registry to hand over what was asked.
PULL_ON_MISS_TIMEOUT_S = 10.0


def mirror_zone(spec: ResolvedSpec, name: str) -> str:
    """The zone whose mirror `name` is (SpecError when the spec runs no such mirror)."""
    zone = name.removeprefix(REGISTRY_MIRROR_PREFIX)
    if name == zone or zone not in spec.registry_mirror_zones():
        mirrors = [registry_mirror_name(z) for z in spec.registry_mirror_zones()]
        raise SpecError(f"no registry mirror named {name!r}; mirrors: {mirrors}")
    return zone


def mirror_process(spec: ResolvedSpec, name: str) -> Instance:
    """A mirror as the process it is: a registry service of its zone (no instance of the
    spec's: nothing routes or scales it)."""
    return Instance(name=name, service="registry", zone=mirror_zone(spec, name))


@dataclass
class PullReport:
    """What one pull brought: versions copied, aliases moved, versions it could not take."""

    versions: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


class Puller:
    """Copies into `store` what the registry behind `channel` has and the store lacks."""

    def __init__(self, store: RegistryStore, channel: grpc.aio.Channel, max_bytes: int) -> None:
        self.store = store
        self.stub = registry_pb2_grpc.RegistryStub(channel)
        self.channel = channel
        self.max_bytes = max_bytes
        # One pull at a time: the loop's and a miss's would otherwise copy the same bytes.
        self._lock = asyncio.Lock()

    async def pull_all(self, timeout_s: float = 30.0) -> PullReport:
        report = PullReport()
        async with self._lock:
            listed = await self.stub.ListModels(registry_pb2.ListModelsRequest(), timeout=timeout_s)
            for model in listed.models:
                await self._pull_model(model, report, timeout_s)
        return report

    async def pull_model(self, name: str, timeout_s: float = PULL_ON_MISS_TIMEOUT_S) -> PullReport:
        """One model's versions and aliases (a read of it missed here)."""
        report = PullReport()
        async with self._lock:
            listed = await self.stub.ListModels(registry_pb2.ListModelsRequest(), timeout=timeout_s)
            for model in listed.models:
                if model.name == name:
                    await self._pull_model(model, report, timeout_s)
        return report

    async def _pull_model(
        self, model: registry_pb2.Model, report: PullReport, timeout_s: float
    ) -> None:
        try:
            await asyncio.to_thread(self.store.create_model, model.name, model.description)
        except AlreadyExistsError:
            pass
        held = {
            record.version: record.sha256
            for record in await asyncio.to_thread(self.store.list_versions, model.name)
        }
        versions = await self.stub.ListVersions(
            registry_pb2.ListVersionsRequest(model=model.name), timeout=timeout_s
        )
        for version in versions.versions:
            where = f"{model.name}/{version.version}"
            if version.version in held:
                if held[version.version] != version.sha256:
                    log.error(
                        "mirror holds other bytes than the registry; kept",
                        extra={"version": where, "registry_sha256": version.sha256},
                    )
                    report.refused.append(where)
                continue
            try:
                await self._copy(model.name, version.version, timeout_s)
            except (RegistryError, ValueError) as exc:
                log.error("could not mirror a version", extra={"version": where, "error": str(exc)})
                report.refused.append(where)
                continue
            report.versions.append(where)
        local = await asyncio.to_thread(self.store.get_model, model.name)
        for alias, version in sorted(model.aliases.items()):
            if local.aliases.get(alias) == version:
                continue
            try:
                await asyncio.to_thread(self.store.set_alias, model.name, alias, version)
            except RegistryError as exc:
                log.error("could not mirror an alias", extra={"alias": alias, "error": str(exc)})
                continue
            report.aliases.append(f"{model.name}@{alias}->{version}")

    async def _copy(self, model: str, version: str, timeout_s: float) -> None:
        record, data = await fetch_verified(
            self.channel, model, version, timeout=max(timeout_s, 60.0), max_bytes=self.max_bytes
        )
        header = header_from_proto(record)

        def store_it() -> None:
            # The store's own upload path: size and sha256 checked against the header.
            with self.store.begin_upload(header) as upload:
                upload.write(data)
                upload.commit()

        await asyncio.to_thread(store_it)


class MirrorServicer(RegistryServicer):
    """The registry's reads over the mirror's store, a miss pulled from the registry first;
    its writes refused."""

    def __init__(
        self,
        store: RegistryStore,
        *,
        puller: Puller,
        primary: str,
        metrics: RegistryMetrics | None = None,
        scope: ModelServerScope | None = None,
        upload_idle_timeout_s: float = UPLOAD_IDLE_TIMEOUT_S,
    ) -> None:
        super().__init__(
            store, metrics=metrics, scope=scope, upload_idle_timeout_s=upload_idle_timeout_s
        )
        self.puller = puller
        self.primary = primary

    async def _refuse(self, context: grpc.aio.ServicerContext, what: str) -> None:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this is a read-only mirror of the registry: {what} at the registry ({self.primary})",
        )

    async def _held_or_pulled(self, model: str, version: str | None) -> None:
        """Pull `model` from the registry when this mirror lacks it (or the version); a
        registry that does not answer leaves the read to answer from what is here."""
        try:
            if version is None:
                await asyncio.to_thread(self.store.get_model, model)
            else:
                await asyncio.to_thread(self.store.get_version, model, version)
            return
        except NotFoundError:
            pass
        try:
            await self.puller.pull_model(model)
        except grpc.aio.AioRpcError as exc:
            log.info("miss not pulled: registry unreachable", extra={"error": exc.code().name})

    async def CreateModel(
        self, request: registry_pb2.CreateModelRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.Model:
        await self._refuse(context, "create models")
        raise AssertionError("unreachable")

    async def UploadVersion(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[registry_pb2.UploadVersionRequest],
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ModelVersion:
        await self._refuse(context, "push versions")
        raise AssertionError("unreachable")

    async def SetAlias(
        self, request: registry_pb2.SetAliasRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.Model:
        await self._refuse(context, "move aliases")
        raise AssertionError("unreachable")

    async def GetVersion(
        self, request: registry_pb2.GetVersionRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ModelVersion:
        await self._held_or_pulled(request.model, request.version)
        return await super().GetVersion(request, context)

    async def ListVersions(
        self, request: registry_pb2.ListVersionsRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListVersionsResponse:
        await self._held_or_pulled(request.model, None)
        return await super().ListVersions(request, context)

    async def DownloadArtifact(
        self, request: registry_pb2.DownloadArtifactRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.ArtifactChunk]:
        await self._held_or_pulled(request.model, request.version)
        async for chunk in super().DownloadArtifact(request, context):
            yield chunk


async def pull_once(puller: Puller, timeout_s: float = 30.0) -> None:
    """One pull of everything, logged; a registry that does not answer leaves the mirror
    serving what it holds."""
    try:
        report = await asyncio.wait_for(puller.pull_all(timeout_s), timeout_s)
    except (grpc.aio.AioRpcError, TimeoutError) as exc:
        what = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "timed out"
        log.info("registry unreachable; serving what is mirrored", extra={"error": what})
        return
    if report.versions or report.aliases:
        log.info("mirrored", extra={"versions": report.versions, "aliases": report.aliases})


async def pull_every(puller: Puller, interval_s: float) -> None:
    """Pull from the registry every `interval_s`, for as long as the mirror serves."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await pull_once(puller)
        except Exception:  # the loop outlives any one bad pull
            log.exception("mirror pull failed")


async def build_mirror_server(spec: ResolvedSpec, name: str) -> ServiceServer:
    """`name`'s mirror of the registry (registry-mirror-<zone>), its store under
    <state_dir>/<name>, pulling from the registry with its own certificate."""
    zone = mirror_zone(spec, name)
    port = spec.registry_mirror_ports[zone]
    store = await open_store(spec, spec.registry_store_dir.with_name(name))
    channel = dial_registry(spec, caller=name).aio_channel(
        options=message_size_options(spec.limits.max_message_bytes)
    )
    puller = Puller(store, channel, spec.limits.max_artifact_bytes)
    # Serving only after a first pull (or a registry that did not answer it): a model
    # server that finds the mirror SERVING finds what the registry held at its start.
    await pull_once(puller)
    server = mesh_registry_server(
        spec,
        name,
        store,
        port,
        make_servicer=partial(MirrorServicer, puller=puller, primary=spec.registry_address),
    )
    server.run_in_background(pull_every(puller, spec.registry.mirror_sync_s))

    async def close_channel() -> None:
        await channel.close()

    server.on_stop(close_channel)
    return server


if __name__ == "__main__":
    from servemesh.services.runtime.entry import service_main

    service_main(build_mirror_server, known=mirror_process)
