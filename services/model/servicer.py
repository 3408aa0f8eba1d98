"""The Open Inference Protocol v2 gRPC servicer: several models and versions in one replica."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable, Mapping
from importlib import metadata

import grpc

from servemesh.services.model.batching import Batcher
from servemesh.services.model.errors import ModelNotFound, RequestError, ServingError
from servemesh.services.model.loader import LoadedModel, ModelLoader
from servemesh.services.model.tensors import decode_request, encode_outputs
from servemesh.services.runtime import DeadlineBudget, bind_request_id
from servemesh.services.runtime.logs import new_request_id
from servemesh.spec import BatchingSpec
from servemesh.wire import REPLICA_PARAMETER, REQUEST_ID_HEADER, VERSION_HEADER, ZONE_PARAMETER
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

log = logging.getLogger(__name__)

SERVER_NAME = "servemesh"
EXTENSIONS = ("model_repository", "statistics")

Key = tuple[str, str]


def natural_key(version: str) -> tuple[object, ...]:
    """Sort key under which v10 comes after v9."""
    parts = re.split(r"(\d+)", version)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def _server_version() -> str:
    try:
        return metadata.version("servemesh")
    except metadata.PackageNotFoundError:
        return "0"


def _int_parameter(params: Mapping[str, oip.InferParameter], name: str) -> int | None:
    """An integer request parameter (int64 or uint64), or None when absent."""
    param = params.get(name)
    if param is None:
        return None
    choice = param.WhichOneof("parameter_choice")
    if choice not in ("int64_param", "uint64_param"):
        raise RequestError(
            f"parameters[{name!r}]: expected an int64_param, got {choice or 'nothing'}"
        )
    return int(getattr(param, choice))


def _priority_level(request: oip.ModelInferRequest, batching: BatchingSpec) -> int:
    """The queue level of a request: OIP/Triton's `priority` parameter, 1 the most urgent,
    0 or absent the model's default level."""
    wanted = _int_parameter(request.parameters, "priority") if request.parameters else None
    if not wanted:
        return batching.default_priority_level
    if not 1 <= wanted <= batching.priority_levels:
        raise RequestError(
            f"parameters['priority']: {wanted} is outside 1..{batching.priority_levels} "
            f"(0 means the default level, {batching.default_priority_level})"
        )
    return wanted


class InferenceServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """GRPCInferenceService for the models loaded in this replica.

    Models are keyed by (model, version). `expected` lists the versions the replica must
    serve before it calls itself ready (ServerReady); `loader` backs RepositoryModelLoad and
    `load_all`. A bad request never crashes the replica: errors become gRPC statuses.
    """

    def __init__(
        self,
        *,
        replica: str,
        zone: str = "",
        loader: ModelLoader | None = None,
        expected: Iterable[Key] = (),
        budget: DeadlineBudget | None = None,
    ) -> None:
        self.replica = replica
        self.zone = zone
        self.loader = loader
        self.budget = budget or DeadlineBudget()
        self.expected: set[Key] = set(expected)
        self._models: dict[Key, LoadedModel] = {}
        # Each model's default version (its highest loaded), kept current by install/unload.
        self._latest: dict[str, str] = {}
        # RepositoryIndex states of versions not (or no longer) serving: LOADING, UNAVAILABLE.
        self._states: dict[Key, tuple[str, str]] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._version = _server_version()

    # --- model management -------------------------------------------------------------

    def models(self) -> dict[Key, LoadedModel]:
        return dict(self._models)

    def batchers(self) -> list[tuple[str, str, Batcher]]:
        """(model, version, batcher) of every version served: what the metrics read."""
        return [
            (model, version, loaded.batcher) for (model, version), loaded in self._models.items()
        ]

    async def install(self, loaded: LoadedModel) -> None:
        """Serve `loaded`; a previous load of the same version drains after the swap."""
        key = (loaded.model, loaded.version)
        previous = self._models.get(key)
        self._models[key] = loaded
        self._states.pop(key, None)
        self._latest[loaded.model] = self.versions_of(loaded.model)[-1]
        if previous is not None and previous is not loaded:
            await previous.close()

    async def load(self, model: str, version: str) -> LoadedModel:
        """Load (or reload) a version with the injected loader and serve it."""
        if self.loader is None:
            raise ServingError(
                "model loading is not configured on this replica",
                code=grpc.StatusCode.UNIMPLEMENTED,
            )
        key = (model, version)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._models:
                self._states[key] = ("LOADING", "")
            try:
                loaded = await self.loader(model, version)
            except Exception as exc:
                reason = (
                    exc.message if isinstance(exc, ServingError) else f"{type(exc).__name__}: {exc}"
                )
                if key not in self._models:
                    self._states[key] = ("UNAVAILABLE", reason[:500])
                log.error(
                    "model load failed",
                    extra={"model": model, "version": version, "reason": reason},
                )
                raise
            if loaded.version != version:  # an alias resolved to a concrete version
                self._states.pop(key, None)
            self.expected.add((loaded.model, loaded.version))
            await self.install(loaded)
            return loaded

    async def load_all(self) -> None:
        """Load every expected version, one after another (they share the same cores)."""
        for model, version in sorted(self.expected, key=lambda k: (k[0], natural_key(k[1]))):
            if (model, version) not in self._models:
                await self.load(model, version)

    async def unload(self, model: str, version: str | None = None) -> list[LoadedModel]:
        """Stop serving one version (or all of a model); queued requests still finish."""
        keys = [k for k in self._models if k[0] == model and (version is None or k[1] == version)]
        if not keys:
            raise self._not_found(model, version)
        gone = [self._models.pop(key) for key in keys]
        versions = self.versions_of(model)
        if versions:
            self._latest[model] = versions[-1]
        else:
            self._latest.pop(model, None)
        for key in keys:
            self.expected.discard(key)
            self._states[key] = ("UNAVAILABLE", "unloaded")
        for loaded in gone:
            await loaded.close()
        return gone

    async def close(self) -> None:
        """Drain every batcher (the server's stop hook)."""
        loaded = list(self._models.values())
        await asyncio.gather(*(model.close() for model in loaded))

    def is_ready(self) -> bool:
        return bool(self._models) and all(key in self._models for key in self.expected)

    # --- resolution -----------------------------------------------------------------

    def versions_of(self, model: str) -> list[str]:
        return sorted((v for m, v in self._models if m == model), key=natural_key)

    def _not_found(self, model: str, version: str | None) -> ModelNotFound:
        versions = self.versions_of(model)
        if not versions:
            return ModelNotFound(f"model {model!r} is not loaded")
        return ModelNotFound(
            f"model {model!r} version {version!r} is not loaded; loaded: {versions}"
        )

    def resolve(self, model: str, version: str = "") -> LoadedModel:
        """The loaded version asked for, or the model's default (its highest version)."""
        if not model:
            raise RequestError("model_name: required")
        if not version:
            latest = self._latest.get(model)
            if latest is None:
                raise self._not_found(model, None)
            version = latest
        loaded = self._models.get((model, version))
        if loaded is None:
            raise self._not_found(model, version)
        return loaded

    # --- health and metadata --------------------------------------------------------

    async def ServerLive(
        self, request: oip.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: oip.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=self.is_ready())

    async def ModelReady(
        self, request: oip.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelReadyResponse:
        try:
            self.resolve(request.name, request.version)
        except ServingError:
            return oip.ModelReadyResponse(ready=False)
        return oip.ModelReadyResponse(ready=True)

    async def ServerMetadata(
        self, request: oip.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerMetadataResponse:
        return oip.ServerMetadataResponse(
            name=SERVER_NAME, version=self._version, extensions=list(EXTENSIONS)
        )

    async def ModelMetadata(
        self, request: oip.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelMetadataResponse:
        try:
            loaded = self.resolve(request.name, request.version)
        except ServingError as exc:
            await context.abort(exc.code, exc.message)
        response = oip.ModelMetadataResponse(
            name=loaded.model, versions=self.versions_of(loaded.model), platform=loaded.platform
        )
        for sig in loaded.signature.inputs:
            response.inputs.add(name=sig.name, datatype=sig.datatype, shape=list(sig.shape))
        for sig in loaded.signature.outputs:
            response.outputs.add(name=sig.name, datatype=sig.datatype, shape=list(sig.shape))
        return response

    # --- inference --------------------------------------------------------------------

    async def ModelInfer(
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        # One pass over the headers: the request id and the version Envoy picked.
        request_id = routed_version = ""
        for key, value in context.invocation_metadata() or ():
            if key == REQUEST_ID_HEADER:
                request_id = (value.decode() if isinstance(value, bytes) else value)[:128]
            elif key == VERSION_HEADER:
                routed_version = value.decode() if isinstance(value, bytes) else value
        request_id = request_id or new_request_id()
        bind_request_id(request_id)
        try:
            return await self._infer(request, context, request_id, routed_version)
        except ServingError as exc:
            code, message = exc.code, exc.message
            if isinstance(exc, (RequestError, ModelNotFound)):
                log.info("request refused", extra={"code": code.name, "error": message})
        except Exception:
            log.exception("ModelInfer failed", extra={"model": request.model_name})
            code, message = grpc.StatusCode.INTERNAL, "internal error"
        await context.abort(code, message)

    def _deadline(self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext) -> float:
        """The earlier of the gRPC deadline and OIP's `timeout` parameter, less our hop budget."""
        deadline = self.budget.absolute_deadline(context)
        timeout_us = _int_parameter(request.parameters, "timeout") if request.parameters else None
        if timeout_us is not None:
            if timeout_us < 0:
                raise RequestError(f"parameters['timeout']: must not be negative, got {timeout_us}")
            if timeout_us > 0:  # 0 means "no timeout" in OIP
                deadline = min(deadline, time.monotonic() + timeout_us / 1e6)
        # Keep time to serialise and send the answer.
        return deadline - self.budget.hop_budget_s

    async def _infer(
        self,
        request: oip.ModelInferRequest,
        context: grpc.aio.ServicerContext,
        request_id: str,
        routed_version: str,
    ) -> oip.ModelInferResponse:
        loaded = self.resolve(request.model_name, request.model_version or routed_version)
        deadline = self._deadline(request, context)
        priority = _priority_level(request, loaded.batching)
        decoded = decode_request(request, loaded.signature, loaded.batching.max_rows_per_request)
        result = await loaded.batcher.submit(decoded.rows, deadline, request_id, priority)
        response = oip.ModelInferResponse(
            model_name=loaded.model, model_version=loaded.version, id=request.id
        )
        response.parameters[REPLICA_PARAMETER].string_param = self.replica
        if self.zone:
            response.parameters[ZONE_PARAMETER].string_param = self.zone
        encode_outputs(response, result, loaded.signature, decoded.outputs, decoded.raw)
        return response

    # --- statistics and repository ------------------------------------------------------

    async def ModelStatistics(
        self, request: oip.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelStatisticsResponse:
        keys = sorted(self._models, key=lambda k: (k[0], natural_key(k[1])))
        if request.name:
            keys = [k for k in keys if k[0] == request.name]
            if request.version:
                keys = [k for k in keys if k[1] == request.version]
            if not keys:
                exc = self._not_found(request.name, request.version or None)
                await context.abort(exc.code, exc.message)
        response = oip.ModelStatisticsResponse()
        for key in keys:
            stats = self._models[key].batcher.stats
            entry = response.model_stats.add(
                name=key[0],
                version=key[1],
                last_inference=stats.last_inference_ms,
                inference_count=stats.inference_count,
                execution_count=stats.executions,
            )
            infer = entry.inference_stats
            for name in (
                "success",
                "fail",
                "queue",
                "compute_input",
                "compute_infer",
                "compute_output",
            ):
                duration = getattr(stats, name)
                target = getattr(infer, name)
                target.count, target.ns = duration.count, duration.ns
            for size, per_size in sorted(stats.batch_sizes.items()):
                batch = entry.batch_stats.add(batch_size=size)
                for name in ("compute_input", "compute_infer", "compute_output"):
                    duration = getattr(per_size, name)
                    target = getattr(batch, name)
                    target.count, target.ns = duration.count, duration.ns
        return response

    async def RepositoryIndex(
        self, request: oip.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> oip.RepositoryIndexResponse:
        rows: dict[Key, tuple[str, str]] = {key: ("READY", "") for key in self._models}
        if not request.ready:
            for key, state in self._states.items():
                rows.setdefault(key, state)
        response = oip.RepositoryIndexResponse()
        for (model, version), (state, reason) in sorted(
            rows.items(), key=lambda item: (item[0][0], natural_key(item[0][1]))
        ):
            response.models.add(name=model, version=version, state=state, reason=reason)
        return response

    async def RepositoryModelLoad(
        self, request: oip.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> oip.RepositoryModelLoadResponse:
        try:
            if not request.model_name:
                raise RequestError("model_name: required")
            param = request.parameters.get("version")
            if (
                param is None
                or param.WhichOneof("parameter_choice") != "string_param"
                or not param.string_param
            ):
                raise RequestError(
                    "parameters['version']: a string_param naming the version is required"
                )
            await self.load(request.model_name, param.string_param)
        except ServingError as exc:
            code, message = exc.code, exc.message
        except Exception as exc:
            code, message = grpc.StatusCode.INTERNAL, f"load failed: {type(exc).__name__}"
        else:
            return oip.RepositoryModelLoadResponse()
        await context.abort(code, message)

    async def RepositoryModelUnload(
        self, request: oip.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> oip.RepositoryModelUnloadResponse:
        param = request.parameters.get("version")
        version = param.string_param if param is not None and param.string_param else None
        try:
            await self.unload(request.model_name, version)
        except ServingError as exc:
            await context.abort(exc.code, exc.message)
        return oip.RepositoryModelUnloadResponse()
