"""The Registry gRPC service (servemesh.registry.v1.Registry) over a RegistryStore.

Status codes:
  INVALID_ARGUMENT     a malformed field (the message names it, e.g. "header.sha256: ..."),
                       an alias that would shadow a version, and uploaded bytes that do
                       not match the header: "chunk data does not match header.sha256" or
                       a size that differs from header.size_bytes.
  NOT_FOUND            an unknown model, version or alias (the message names it).
  ALREADY_EXISTS       CreateModel of an existing model; UploadVersion of an existing
                       version with other bytes (the same bytes return the version).
  FAILED_PRECONDITION  an upload stream whose first message is not a header, that carries
                       a second header, or that ends without one.
  RESOURCE_EXHAUSTED   an artifact over the registry's max_artifact_bytes: refused at the
                       header when declared so, else at the first chunk past the limit;
                       an artifact that would pass the quota on stored bytes
                       (limits.registry_quota_bytes), refused at the header.
  DEADLINE_EXCEEDED    an upload stream that sent nothing for limits.upload_idle_timeout_s:
                       aborted, leaving no temp file, row or blob.
  UNAUTHENTICATED,     CreateModel, UploadVersion and SetAlias without (or with a wrong)
  PERMISSION_DENIED    control credential (services/runtime/control_auth.py).
  DATA_LOSS            a version whose artifact file is missing on disk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from servemesh.contract.wire import REGISTRY_SERVICE
from servemesh.registry.convert import header_from_proto, model_to_proto, version_to_proto
from servemesh.registry.errors import (
    RegistryError,
    UploadIdleError,
    UploadProtocolError,
)
from servemesh.registry.metrics import RegistryMetrics
from servemesh.registry.records import UploadHeader
from servemesh.registry.scope import ModelServerScope
from servemesh.registry.store import RegistryStore, Upload
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = REGISTRY_SERVICE
DOWNLOAD_CHUNK_BYTES = 256 * 1024
UPLOAD_IDLE_TIMEOUT_S = 30.0

T = TypeVar("T")


@dataclass
class _Receiving:
    """An upload stream in progress: what it declared, and the upload once begun."""

    header: UploadHeader | None = None
    upload: Upload | None = None

    def log_fields(self) -> dict[str, object]:
        """What the upload's log lines say: the header (bounded), never the bytes."""
        if self.header is None:
            return {}
        return {
            # Not yet validated when a header is refused: keep a caller from flooding logs.
            "model": self.header.model[:128],
            "version": self.header.version[:128],
            "size_bytes": self.header.size_bytes,
            "sha256": self.header.sha256[:64],
            "received_bytes": self.upload.received_bytes if self.upload is not None else 0,
        }


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    """Every Registry RPC; store calls run in threads so the event loop never waits on disk."""

    def __init__(
        self,
        store: RegistryStore,
        *,
        download_chunk_bytes: int = DOWNLOAD_CHUNK_BYTES,
        upload_idle_timeout_s: float = UPLOAD_IDLE_TIMEOUT_S,
        metrics: RegistryMetrics | None = None,
        scope: ModelServerScope | None = None,
    ) -> None:
        self.store = store
        # Which artifacts a model server may download (None: every caller, every model).
        self.scope = scope
        self.metrics = metrics or RegistryMetrics()
        self.download_chunk_bytes = download_chunk_bytes
        self.upload_idle_timeout_s = upload_idle_timeout_s

    async def _call(
        self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: object
    ) -> T:
        """fn(*args) in a thread (a store refusal reaches the caller with its status)."""
        try:
            return await asyncio.to_thread(fn, *args)
        except RegistryError as exc:
            self.metrics.errors.labels(fn.__name__, exc.code.name).inc()
            raise

    async def CreateModel(
        self, request: registry_pb2.CreateModelRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.Model:
        record = await self._call(
            context, self.store.create_model, request.name, request.description
        )
        return model_to_proto(record)

    async def ListModels(
        self, request: registry_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListModelsResponse:
        records = await self._call(context, self.store.list_models)
        return registry_pb2.ListModelsResponse(models=[model_to_proto(r) for r in records])

    async def GetVersion(
        self, request: registry_pb2.GetVersionRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ModelVersion:
        record = await self._call(context, self.store.get_version, request.model, request.version)
        return version_to_proto(record)

    async def ListVersions(
        self, request: registry_pb2.ListVersionsRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListVersionsResponse:
        records = await self._call(context, self.store.list_versions, request.model)
        return registry_pb2.ListVersionsResponse(versions=[version_to_proto(r) for r in records])

    async def SetAlias(
        self, request: registry_pb2.SetAliasRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.Model:
        record = await self._call(
            context, self.store.set_alias, request.model, request.alias, request.version
        )
        self.metrics.aliases.inc()
        log.info(
            "alias set",
            extra={
                "model": record.name,
                "alias": request.alias,
                "target": record.aliases[request.alias],
            },
        )
        return model_to_proto(record)

    async def UploadVersion(
        self,
        request_iterator: AsyncIterable[registry_pb2.UploadVersionRequest],
        context: grpc.aio.ServicerContext,
    ) -> registry_pb2.ModelVersion:
        """Header first, then chunks; the version exists once every byte matched.

        Auto-creates the model, so one stream publishes a new model's first version.
        """
        receiving = _Receiving()
        messages = aiter(request_iterator)
        try:
            while (message := await self._next_message(messages)) is not None:
                await self._accept(receiving, message)
            if receiving.upload is None:
                raise UploadProtocolError("header: the upload stream ended without one")
            upload = receiving.upload
            record = await asyncio.to_thread(upload.commit)
        except RegistryError as exc:
            self.metrics.uploads["refused"].inc()
            self.metrics.errors.labels("upload", exc.code.name).inc()
            log.warning(
                "upload refused",
                extra={**receiving.log_fields(), "code": exc.code.name, "reason": exc.message},
            )
            raise
        except asyncio.CancelledError:
            self.metrics.uploads["cancelled"].inc()
            log.info("upload cancelled by the client", extra=receiving.log_fields())
            raise
        finally:
            # Synchronous on purpose: it must run even while this task is being cancelled.
            # A no-op after a commit, and while a commit still runs in its thread.
            if receiving.upload is not None:
                receiving.upload.abort()
        if upload.created:
            self.metrics.uploads["accepted"].inc()
            self.metrics.upload_bytes.inc(record.size_bytes)
        else:
            self.metrics.uploads["existing"].inc()
        log.info(
            "upload accepted",
            extra={
                "model": record.model,
                "version": record.version,
                "size_bytes": record.size_bytes,
                "sha256": record.sha256,
                "new_version": upload.created,
            },
        )
        return version_to_proto(record)

    async def _next_message(
        self, messages: AsyncIterator[registry_pb2.UploadVersionRequest]
    ) -> registry_pb2.UploadVersionRequest | None:
        """The stream's next message, None at its end; an uploader that goes quiet for
        longer than the idle timeout holds a temp file and a stream no longer."""
        try:
            return await asyncio.wait_for(anext(messages), self.upload_idle_timeout_s)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise UploadIdleError(
                f"upload: no message for {self.upload_idle_timeout_s:g} s "
                "(limits.upload_idle_timeout_s); nothing was stored"
            ) from None

    async def _accept(
        self, receiving: _Receiving, message: registry_pb2.UploadVersionRequest
    ) -> None:
        """Take one more message: the header begins the upload, each chunk feeds it."""
        part = message.WhichOneof("part")
        if receiving.header is None:
            if part != "header":
                raise UploadProtocolError("header: the first UploadVersionRequest must carry it")
            receiving.header = header_from_proto(message.header)
            # begin_upload opens no file, so a cancellation right here leaks nothing.
            receiving.upload = await asyncio.to_thread(self.store.begin_upload, receiving.header)
        elif part == "header":
            raise UploadProtocolError("header: sent twice; only the first message may carry it")
        elif part == "chunk" and message.chunk and receiving.upload is not None:
            await asyncio.to_thread(receiving.upload.write, message.chunk)

    async def DownloadArtifact(
        self, request: registry_pb2.DownloadArtifactRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.ArtifactChunk]:
        """The artifact in chunks; the first carries the ModelVersion to verify against and
        its ETag (the sha256). A caller whose if_none_match is that ETag (a device that holds
        the alias's current artifact) gets one not_modified message and no bytes.

        Read a chunk at a time in a thread: a large artifact never sits in memory whole.
        """
        if self.scope is not None:
            await self.scope.check_download(context, request.model)
        record = await self._call(context, self.store.get_version, request.model, request.version)
        if request.if_none_match and request.if_none_match == record.sha256:
            self.metrics.not_modified.inc()
            yield registry_pb2.ArtifactChunk(
                version=version_to_proto(record), etag=record.sha256, not_modified=True
            )
            return
        self.metrics.downloads.inc()
        # Opened here, not in a thread: a cancellation mid-open would leak the handle.
        blob = self.store.open_artifact(record)
        with blob:
            data = await asyncio.to_thread(blob.read, self.download_chunk_bytes)
            self.metrics.download_bytes.inc(len(data))
            yield registry_pb2.ArtifactChunk(
                version=version_to_proto(record), data=data, etag=record.sha256
            )
            while data:
                data = await asyncio.to_thread(blob.read, self.download_chunk_bytes)
                if data:
                    self.metrics.download_bytes.inc(len(data))
                    yield registry_pb2.ArtifactChunk(data=data)
